"""MCP at ``/gradio_api/mcp/``: the ``generate`` and ``image_to_image`` tools (tools.py), served with the mcp SDK's
own server over streamable HTTP, stateless (each POST is its own exchange, as Gradio's MCP server was), and run as
jobs of the service like every other front's requests.

A tool call is parsed (the schema's types, then tools.tool_inputs for the picture), built into the service's request
(request.to_request), submitted for its owner (core.owner_of: the API key, else the client's address) and client
(the per-client cap counts it with the client's other requests, whatever their front) and awaited; its answer is
each image as PNG image content (the job's PNG bytes, with their A1111 parameters: nothing is written to disk or
read back) and then the info record as JSON text. A refusal or a failure is a tool error (``isError``) with the
service's or the engine's message, naming the field by the tool's own input name (``upscale``, not
``hires_scale``). While a call runs, a client that sent a ``progressToken`` gets a progress notification per
denoising step. When the call's task ends before its job (the client closed the call's connection, or cancelled it
with ``notifications/cancelled`` within its session, or the server stops), the job is stopped: a queued one never
runs, a running one stops after its running step.

No Gradio here: :meth:`McpServer.mount` adds the route to the app (apis.mount), and the SDK's session manager runs
in the app's lifespan (:meth:`McpServer.running`, entered by server.before_listening).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Callable

import jsonschema
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

import sdxl_engine.serving.apis.tools as tools  # as a module, not through the package (no import cycle)
from sdxl_engine.config import MODEL_DEFAULT_FIELDS
from sdxl_engine.engine.errors import EngineNotReady, InvalidRequest
from sdxl_engine.service import models
from sdxl_engine.service.jobs import FAILED, Job
from sdxl_engine.service.request import Request, to_request
from sdxl_engine.service.service import Refused, Service
from sdxl_engine.service.styles import NO_STYLE
from sdxl_engine.serving import admission, guard
from sdxl_engine.serving.apis.core import job_error, wait_started
from sdxl_engine.serving.apis.errors import ApiError
from sdxl_engine.serving.guard import MAX_IMAGE_BODY_BYTES, MCP_PATH

LOG = logging.getLogger(__name__)

NAME = "SDXL"  # the server's name in MCP's initialize answer
# An input's JSON type by its kind; ``list`` (ip_adapter_embeds): an array, or the same as JSON text.
JSON_TYPES = {str: "string", int: "integer", float: "number", list: ["array", "string"]}


class ToolRefusal(Exception):
    """A tool call refused or failed: the SDK answers it as a tool error whose text is the message."""


def tool(name: str, inputs: tuple[tools.Input, ...], doc: str) -> types.Tool:
    """The MCP tool ``name``: its description and each input's from ``doc`` (tools.describe), its input schema
    from ``inputs`` (JSON type, the choices as an enum, the default; the inputs without one required), in order."""
    description, described = tools.describe(doc)
    properties = {}
    for item in inputs:
        schema: dict = {"type": JSON_TYPES[item.kind]}
        if item.choices:
            schema["enum"] = list(item.choices)
        if item.name in described:
            schema["description"] = described[item.name]
        if item.default is not tools.REQUIRED:
            schema["default"] = item.default
        properties[item.name] = schema
    required = [item.name for item in inputs if item.default is tools.REQUIRED]
    return types.Tool(name=name, description=description,
                      inputSchema={"type": "object", "properties": properties, "required": required})


class McpServer:
    """The MCP server of the module docstring.

    Args:
        requests: the service every call is a job of.
        config: the page's resolved EngineConfig (handler.page_defaults): the tools' defaults.
        owner_of: ``(starlette request) -> owner`` (core.owner_of with the server's API key).
    """

    def __init__(self, requests: Service, config, owner_of: Callable):
        self.requests = requests
        self.owner_of = owner_of
        self.inputs = {tools.GENERATE: tools.generate_inputs(config),
                       tools.IMAGE_TO_IMAGE: tools.image_inputs(config)}
        self.tools = self.described([])
        self.server = Server(NAME)
        self.server.list_tools()(self.list_tools)
        self.server.call_tool(validate_input=False)(self.call_tool)  # checked by arguments_refusal instead
        # Stateless: no session to keep or expire. The guard caps bodies first (48 MB for an image tool call only).
        self.manager = StreamableHTTPSessionManager(self.server, stateless=True,
                                                    max_request_body_size=MAX_IMAGE_BODY_BYTES)

    # ---- the HTTP side ---------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        await self.manager.handle_request(scope, receive, send)

    def mount(self, app) -> None:
        """Serve at ``/gradio_api/mcp`` and ``/gradio_api/mcp/`` on ``app`` (a FastAPI app), every method."""
        for path in (MCP_PATH, MCP_PATH + "/"):
            app.add_route(path, self, include_in_schema=False)

    def running(self) -> contextlib.AbstractAsyncContextManager:
        """The SDK's session manager's run, for the app's lifespan: calls are served only inside it."""
        return self.manager.run()

    # ---- the tools -------------------------------------------------------------------------------------------------
    def described(self, names: list[str]) -> list[types.Tool]:
        """The two tools, their ``model`` input describing the models ``names`` (the default first)."""
        return [tool(tools.GENERATE, self.inputs[tools.GENERATE], tools.generate_doc(names)),
                tool(tools.IMAGE_TO_IMAGE, self.inputs[tools.IMAGE_TO_IMAGE], tools.image_doc(names))]

    async def list_tools(self) -> list[types.Tool]:
        """The tools, their ``model`` input listing the models offered now (once the engine has started)."""
        engine = self.requests.engine
        if engine.ready.is_set() and engine.error is None:
            self.tools = self.described(models.names(engine))
        return self.tools

    async def call_tool(self, name: str, arguments: dict) -> list:
        """Run one tool call as a job (see the module docstring); its content, or ToolRefusal."""
        context = self.server.request_context
        http = context.request  # the Starlette request of the POST that carried the call
        client = admission.client_address(http)
        asked = await self.request_for(name, arguments, client)
        job = self.submit(name, asked, http, client)
        try:
            await self.follow(job, context)
        finally:
            if not job.done:  # the call's task ended first: cancelled, the client gone, the server stopping
                LOG.info(f"[app] an MCP {name} call ended before its job: stopping it")
                self.requests.stop(job)
        return answer(job)

    async def request_for(self, name: str, arguments: dict, client: str) -> Request:
        """The service's request for a call of tool ``name`` with ``arguments`` (checked against the tool's schema
        first: :func:`arguments_refusal`).

        Raises ToolRefusal: an unknown tool, an argument the tool does not take or of the wrong type, a required one
        missing, a picture it cannot use, an unknown style, the engine failed to start."""
        inputs = self.inputs.get(name)
        if inputs is None:
            raise refused(name, f"unknown tool {name!r}; this server's tools: {', '.join(self.inputs)}")
        schema = next(listed.inputSchema for listed in self.tools if listed.name == name)
        if (message := arguments_refusal(schema, arguments)) is not None:
            raise refused(name, message)
        # Sampler, steps and guidance left out are the named model's own (None: the engine fills in its defaults,
        # as A1111 and the jobs API do); the schema's defaults are the default model's, the same values for it.
        values = {item.name: arguments.get(item.name, None if item.name in MODEL_DEFAULT_FIELDS else item.default)
                  for item in inputs}
        try:
            if name == tools.GENERATE:  # as the page's /generate reads its inputs (a control image decoded)
                return to_request(**await asyncio.to_thread(tools.request_values, values), client=client)
            control = {n: values.pop(n) for n in tools.CONTROL_NAMES}
            if control["control_image"]:
                control = await asyncio.to_thread(tools.control_fields, **control)  # the image decoded
            else:
                control = {}
            ip = await asyncio.to_thread(tools.ip_fields, **{n: values.pop(n) for n in tools.IP_UNIT_NAMES})
            ip_names = {**control.pop("field_names", {}), **ip.pop("field_names", {})}  # the units' input names
            engine = self.requests.engine
            await wait_started(engine)  # the picture is resized to the model's default size
            if engine.error is not None:
                raise refused(name, f"the engine failed to start: {engine.error}")
            fields, paste_back, w, h = await asyncio.to_thread(
                tools.tool_inputs, values["image"], values["mask"], values["strength"], values["width"],
                values["height"], engine.limits.default_size, values["refiner_switch_at"], values["upscale"],
                engine.limits if values["model"] in (None, "", engine.limits.model) else None)  # the default model's
            return to_request(prompt=values["prompt"], negative_prompt=values["negative_prompt"], seed=values["seed"],
                              guidance_scale=values["guidance_scale"],
                              num_inference_steps=values["num_inference_steps"], width=w, height=h,
                              sampler=values["sampler"], schedule_type=values["schedule_type"], style=NO_STYLE,
                              client=client, paste_back=paste_back,
                              field_names={**tools.field_names(fields), **ip_names}, **fields, **control, **ip,
                              **tools.model_field(values["model"]))
        except ApiError as err:
            raise refused(name, err.message) from None
        except InvalidRequest as err:
            raise refused(name, str(err)) from None

    def submit(self, name: str, asked: Request, http, client: str) -> Job:
        """Queue ``asked`` in the service as the caller's job (front "mcp").

        Raises ToolRefusal: over the client's cap, the line full, shutting down, the engine failed to start, a value
        the engine refuses (its field under the tool's input name)."""
        try:
            return self.requests.submit(asked, owner=self.owner_of(http), front="mcp", client=client,
                                        arrived=guard.arrival_time(http))
        except Refused as err:
            raise ToolRefusal(err.message) from None  # the service logged it
        except InvalidRequest as err:
            raise refused(name, f"{asked.field(err.field)}: {err.message}") from None
        except EngineNotReady as err:
            raise refused(name, str(err)) from None

    @staticmethod
    async def follow(job: Job, context) -> None:
        """Wait (without a thread) until ``job`` has finished; a progress notification per denoising step when the
        call asked for them (its ``progressToken``)."""
        token = context.meta.progressToken if context.meta is not None else None
        seen = 0
        while not job.done:
            events = await job.next_events(seen, timeout=1.0)
            seen += len(events)
            if token is None:
                continue
            for event, data in events:
                if event == "step":
                    done, total = data["call"] * data["steps"] + data["step"], data["calls"] * data["steps"]
                    await context.session.send_progress_notification(
                        token, done, total, f"step {data['step']}/{data['steps']}",
                        related_request_id=context.request_id)


def answer(job: Job) -> list:
    """A finished job's tool result: each image as PNG image content, then the info record as JSON text; a failed
    or stopped job is a ToolRefusal with its message (core.job_error: the field under the tool's input name)."""
    if job.status == FAILED:
        raise ToolRefusal(job_error(job, job.request).message)
    if job.result is None:  # stopped before any image was made
        raise ToolRefusal("the request was stopped")
    images = [types.ImageContent(type="image", mimeType="image/png", data=base64.b64encode(png).decode())
              for png in job.result.pngs]
    return [*images, types.TextContent(type="text", text=json.dumps(job.result.info))]


def arguments_refusal(schema: dict, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit a tool's input ``schema`` (JSON Schema's message, after the argument it names:
    ``seed: 'five' is not of type 'integer'``; an argument the tool does not take names its inputs), or None."""
    inputs = list(schema["properties"])
    if unknown := [key for key in arguments if key not in inputs]:
        return f"{unknown[0]}: not an input of this tool; its inputs: {', '.join(inputs)}"
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is None:
        return None
    if error.validator == "required":
        missing = next((key for key in schema["required"] if key not in arguments), "arguments")
        return f"{missing}: is required"
    return f"{'.'.join(str(part) for part in error.absolute_path) or 'arguments'}: {error.message}"


def refused(name: str, message: str) -> ToolRefusal:
    """A call refused before it was queued: one log line, and the ToolRefusal to raise."""
    LOG.info(f"[app] request refused: MCP {name}: {message}")
    return ToolRefusal(message)
