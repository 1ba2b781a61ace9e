"""Everything traced: the jitted program (generate.py), the samplers as per-step coefficients
(schedulers.py), the mesh and shardings (sharding.py) and compiled programs kept on disk
(executables.py). The executable cache's source digest covers this folder and models/."""
