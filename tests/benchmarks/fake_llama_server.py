"""A stand-in for llama.cpp's ``llama-server`` (the few flags and endpoints the benchmark driver uses).

It records its command line and every ``/completion`` body to the JSON file named by
``FAKE_LLAMA_RECORD`` and holds each completion until ``FAKE_LLAMA_EXPECT`` of them are in flight
(or 10 s pass), so a test can tell whether the driver sent them all at once. ``FAKE_LLAMA_SHORT``:
answer one token short; ``FAKE_LLAMA_CRASH``: exit at start with an error on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    if "--version" in sys.argv:
        print("version: 4242 (abc1234)\nbuilt with fake for testing", file=sys.stderr)
        return
    if os.environ.get("FAKE_LLAMA_CRASH"):
        print("error: boom, cannot load the model", file=sys.stderr)
        sys.exit(1)
    p = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "-np", "-c", "-t", "-tb", "-fa", "-cram"):
        p.add_argument(flag, required=True)
    p.add_argument("--no-kv-unified", action="store_true")
    args = p.parse_args()
    expect = int(os.environ.get("FAKE_LLAMA_EXPECT", "1"))
    record = {"argv": sys.argv[1:], "bodies": [], "max_in_flight": 0, "health_calls": 0}
    lock = threading.Lock()
    everyone_here = threading.Event()
    in_flight = [0]

    def save() -> None:
        with open(os.environ["FAKE_LLAMA_RECORD"], "w") as f:
            json.dump(record, f)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                with lock:
                    record["health_calls"] += 1
                    loading = record["health_calls"] <= 2  # as while the model loads
                self._send(503 if loading else 200, {"status": "loading model" if loading else "ok"})
            elif self.path == "/props":
                self._send(200, {"build_info": "b4242-abc1234", "total_slots": int(args.np)})
            else:
                self._send(404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                record["bodies"].append(body)
                in_flight[0] += 1
                record["max_in_flight"] = max(record["max_in_flight"], in_flight[0])
                if in_flight[0] >= expect:
                    everyone_here.set()
                save()
            everyone_here.wait(10)
            predicted = body["n_predict"] - (1 if os.environ.get("FAKE_LLAMA_SHORT") else 0)
            with lock:
                in_flight[0] -= 1
            self._send(200, {"content": "", "tokens_predicted": predicted, "tokens_evaluated": len(body["prompt"]),
                             "truncated": False, "stop_type": "limit"})

    server = ThreadingHTTPServer((args.host, int(args.port)), Handler)
    save()
    server.serve_forever()


if __name__ == "__main__":
    main()
