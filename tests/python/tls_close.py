"""Sends one raw HTTP/1.x request over TLS and reads the answer to the connection's end.

Prints the answer; exits 0 only when the server ended the TLS session with close_notify (a
clean EOF), 1 when the connection just ended (for an answer framed by the connection's end,
HTTP/1.0 streaming, a truncation could not be told from a complete answer).

Usage: tls_close.py HOST PORT REQUEST   (REQUEST with \\r\\n escapes)
"""

import socket
import ssl
import sys


def main() -> int:
    host, port, request = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection((host, port), timeout=10)
    tls = ctx.wrap_socket(raw, suppress_ragged_eofs=False)
    tls.sendall(request.encode().decode("unicode_escape").encode("latin-1"))
    answer = b""
    try:
        while True:
            data = tls.recv(65536)
            if not data:
                break
            answer += data
    except ssl.SSLError as e:
        sys.stdout.write(answer.decode("utf-8", "replace"))
        print(f"\nno close_notify: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(answer.decode("utf-8", "replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
