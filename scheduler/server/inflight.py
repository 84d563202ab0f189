"""The frontend's requests in flight, each found two ways: by (client identity, request id) for the client's
messages, and by engine id for the scheduler's outputs, which are routed here into the request's queue.

Client request ids are only unique per client, so each request gets an engine id unique within the frontend;
the scheduler sees only that. This table is the supervisor's `EngineHandler`; it sends nothing itself.
"""

from __future__ import annotations

import itertools

from specstep.scheduler.server.metrics import ServerMetrics
from specstep.scheduler.server.protocol import EngineOutputs, EngineReject, GenerateRequest
from specstep.scheduler.server.request_stream import DIED, RequestStream


class InflightRequests:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics  # counts every output as it is read, in the scheduler's order (see `on_outputs`)
        self._by_client: dict[tuple[bytes, str], RequestStream] = {}
        self._by_engine_id: dict[str, RequestStream] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_client)

    def get(self, identity: bytes, request_id: str) -> RequestStream | None:
        return self._by_client.get((identity, request_id))

    def add(self, identity: bytes, msg: GenerateRequest, now: float) -> RequestStream:
        st = RequestStream(identity, msg, str(next(self._ids)), now)
        self._by_client[(identity, msg.request_id)] = st
        self._by_engine_id[st.engine_id] = st
        return st

    def remove(self, st: RequestStream) -> None:
        self._by_client.pop((st.identity, st.request_id), None)
        self._by_engine_id.pop(st.engine_id, None)

    def cancel_all(self, reason: str) -> None:
        for st in list(self._by_client.values()):
            st.cancel(reason)

    # ---- EngineHandler: the scheduler's messages, from the supervisor's reader task ---------------------------
    def on_outputs(self, msg: EngineOutputs) -> None:
        for out in msg.outputs:
            # Counted here, not from the request's FINAL: a STATS reply is read after every output sent before
            # it, so the counters then hold what the scheduler's EngineStats hold, also for the steps it ran after
            # a stop string or an abort (their outputs find no request here).
            self.metrics.observe_engine_output(out)
            st = self._by_engine_id.get(out.request_id)
            if st is not None:
                st.queue.put_nowait(out)

    def on_reject(self, msg: EngineReject) -> None:
        st = self._by_engine_id.get(msg.request_id)
        if st is not None:
            st.queue.put_nowait(msg)

    def on_engine_died(self, incarnation: int) -> None:
        for st in self._by_engine_id.values():
            if st.incarnation == incarnation:
                st.queue.put_nowait(DIED)
