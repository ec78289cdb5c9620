"""An independent HTTP/3 client (aioquic) for the end-to-end tests.

Sends one request over HTTP/3 and prints a JSON line: {"status": int, "headers": {...},
"body": str, "data_frames": int}. Used to check the gateway's HTTP/3 front and that the tunnel
port shows its masquerade site to clients without the tunnel token.

Usage: h3_client.py HOST PORT METHOD PATH [--body JSON] [--header NAME:VALUE ...]
"""

import argparse
import asyncio
import json
import ssl
import sys

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.waiters = {}
        self.results = {}

    def quic_event_received(self, event):
        for ev in self.h3.handle_event(event):
            if isinstance(ev, (HeadersReceived, DataReceived)):
                r = self.results.setdefault(
                    ev.stream_id, {"status": None, "headers": {}, "body": b"", "data_frames": 0}
                )
                if isinstance(ev, HeadersReceived):
                    for k, v in ev.headers:
                        k, v = k.decode(), v.decode()
                        if k == ":status":
                            r["status"] = int(v)
                        else:
                            r["headers"][k] = v
                else:
                    r["body"] += ev.data
                    if ev.data:
                        r["data_frames"] += 1
                if ev.stream_ended and ev.stream_id in self.waiters:
                    self.waiters.pop(ev.stream_id).set_result(None)

    async def request(self, authority, method, path, headers, body):
        sid = self._quic.get_next_available_stream_id()
        hdrs = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ] + [(k.encode(), v.encode()) for k, v in headers]
        self.h3.send_headers(sid, hdrs, end_stream=body is None)
        if body is not None:
            self.h3.send_data(sid, body.encode(), end_stream=True)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[sid] = fut
        self.transmit()
        await asyncio.wait_for(fut, timeout=20)
        return self.results[sid]


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("method")
    p.add_argument("path")
    p.add_argument("--body")
    p.add_argument("--header", action="append", default=[])
    a = p.parse_args()
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    config.verify_mode = ssl.CERT_NONE
    headers = [tuple(h.split(":", 1)) for h in a.header]
    if a.body is not None:
        headers.append(("content-type", "application/json"))
    async with connect(a.host, a.port, configuration=config, create_protocol=Client) as client:
        r = await client.request(f"{a.host}:{a.port}", a.method, a.path, headers, a.body)
    r["body"] = r["body"].decode("utf-8", "replace")
    print(json.dumps(r))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as e:  # a clear one-line failure for the Rust test to show
        print(f"h3 client failed: {e!r}", file=sys.stderr)
        sys.exit(1)
