"""The engine: one per process (local.py), the requests it takes and their validation
(validation.py), and its TEST-ONLY fault injection (faults.py)."""
