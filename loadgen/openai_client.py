"""An async client of OpenAI-compatible servers (`/v1/completions`, streamed): specstep's HTTP API, llama.cpp's
llama-server, vLLM. It has loadgen's client interface (loadgen/client.py), so one sweep measures any of them
beside the ZMQ protocol with the same metrics.

A request is sent as a streamed completion with `stream_options.include_usage`: TTFT and inter-token gaps are
taken at each event carrying text, the token count from the usage the server reports (every server named above
sends it), and speculation figures and server timings from specstep's `specstep` field where present. Token-id
prompts are sent as lists of ids, so every server gets exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from specstep.loadgen.client import CLIENT_TIMEOUT, Result, poll_ready
from specstep.scheduler.server.protocol import (
    Error,
    ErrorCode,
    Final,
    GenerateRequest,
    HealthReply,
    SpecStats,
    StatsReply,
    Timings,
    Usage,
)

HTTP_ERROR = -2  # an error code of our own: the server answered with an HTTP error (the message says which)


class OpenAIClient:
    def __init__(self, url: str, model: str | None = None) -> None:
        self.address = url.rstrip("/")
        self.base = self.address.removesuffix("/v1")
        self.model = model  # the name to send; None: the first one the server lists
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection limit: a closed loop at concurrency c holds c streams open at once.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    def body(self, req: GenerateRequest) -> dict:
        body = {"model": self.model, "prompt": req.prompt if req.prompt is not None else req.prompt_token_ids,
                "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "stream": True,
                "stream_options": {"include_usage": True}}
        # Extensions only where set, so a server that knows none of them still takes the request.
        for name, value in (("top_k", req.top_k), ("seed", req.seed), ("stop", req.stop),
                            ("stop_token_ids", req.stop_token_ids), ("ignore_eos", req.ignore_eos),
                            ("num_spec_tokens", req.num_spec_tokens)):
            if value:
                body[name] = value
        return body

    async def complete(self, req: GenerateRequest, timeout_s: float | None = None) -> Result:
        """The whole request, streamed; past `timeout_s` the connection is closed (the server aborts the
        request) and the result carries a CLIENT_TIMEOUT error."""
        res = Result(req.request_id, address=self.address, start=time.perf_counter())
        try:
            await asyncio.wait_for(self._stream(req, res), timeout_s)
        except asyncio.TimeoutError:
            res.error = Error(CLIENT_TIMEOUT, f"client-side timeout after {timeout_s:g} s", req.request_id)
        except aiohttp.ClientError as e:
            res.error = Error(ErrorCode.UNAVAILABLE, f"{type(e).__name__}: {e}", req.request_id)
        res.end = time.perf_counter()
        return res

    async def _stream(self, req: GenerateRequest, res: Result) -> None:
        if self.model is None:
            await self.health()
        async with self._http().post(f"{self.base}/v1/completions", json=self.body(req)) as resp:
            if resp.status != 200:
                text = await resp.text()
                res.error = Error(HTTP_ERROR, f"HTTP {resp.status}: {text[:500]}", req.request_id)
                return
            reason, usage, ext = None, None, {}
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":  # read on to the end of the body: the connection is then kept for reuse
                    continue
                event = msgspec.json.decode(data)
                if "error" in event:
                    res.error = Error(HTTP_ERROR, str(event["error"].get("message")), req.request_id)
                    return
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        res.chunk_times.append(time.perf_counter())
                        res.text += choice["text"]
                        res.num_deltas += 1
                    reason = choice.get("finish_reason") or reason
                usage = event.get("usage") or usage
                ext = event.get("specstep") or ext
        n = usage["completion_tokens"] if usage else len(res.chunk_times)
        prompt = usage["prompt_tokens"] if usage else 0
        res.final = Final(req.request_id, reason or "stop", [], "", Usage(prompt, n), _struct(SpecStats, ext),
                          _struct(Timings, ext.get("timings") or {}), ext.get("num_preemptions", 0))

    async def health(self, timeout_s: float = 5.0) -> HealthReply:
        """specstep's /health when the server has it; else "ok" once /v1/models answers (its first model)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._http().get(f"{self.base}/v1/models", timeout=timeout) as resp:
                models = await resp.json() if resp.status == 200 else {}
            async with self._http().get(f"{self.base}/health", timeout=timeout) as resp:
                own = await resp.read()  # specstep's is JSON; other servers' may be empty or plain text
        except (aiohttp.ClientError, ValueError) as e:
            raise asyncio.TimeoutError(f"{self.address}: {e}") from None
        try:
            own = msgspec.json.decode(own)
        except msgspec.DecodeError:
            own = None
        names = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
        if self.model is None and names:
            self.model = names[0]
        if isinstance(own, dict) and "protocol_version" in own:  # specstep
            return _struct(HealthReply, own)
        return HealthReply(0, "ok" if names else "starting", self.model or "")

    async def wait_ready(self, timeout_s: float = 120.0) -> HealthReply:
        return await poll_ready(self.health, timeout_s)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """An OpenAI server has no STATS: nothing to wait for."""

    async def stats(self, timeout_s: float = 10.0) -> StatsReply | None:
        return None

    def close(self) -> None:
        if self._session is not None and not self._session.closed:
            session, self._session = self._session, None
            try:
                asyncio.get_running_loop().create_task(session.close())
            except RuntimeError:  # no loop running any more: its sockets go with the process
                pass


def _struct(cls: type[msgspec.Struct], fields: dict):
    """`cls` from the fields of `fields` it has (others ignored)."""
    return cls(**{k: v for k, v in fields.items() if k in cls.__struct_fields__})
