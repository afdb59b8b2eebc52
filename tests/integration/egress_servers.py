"""Tiny servers for test_sandbox_egress, run inside the test's network namespaces.

`tcp ADDR PORT`: answers every connection with `hello <local address>:<port>` and closes.
`dns ADDR PORT ANSWER`: a UDP resolver that answers every A query with ANSWER.
Prints `ready` once bound.
"""

from __future__ import annotations

import socket
import sys
import threading


def tcp(addr: str, port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        try:
            host, lport = conn.getsockname()[:2]
            conn.sendall(f"hello {host}:{lport}\n".encode())
        finally:
            conn.close()


def dns(addr: str, port: int, answer: str) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind((addr, port))
    print("ready", flush=True)
    while True:
        q, peer = srv.recvfrom(512)
        end = q.index(b"\x00", 12) + 5  # the question: name, type, class
        head = q[:2] + b"\x81\x80" + b"\x00\x01\x00\x01\x00\x00\x00\x00"
        rr = b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04" + socket.inet_aton(answer)
        srv.sendto(head + q[12:end] + rr, peer)


if __name__ == "__main__":
    mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    target = tcp if mode == "tcp" else dns
    args = (addr, port) if mode == "tcp" else (addr, port, sys.argv[4])
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    t.join()
