#!/usr/bin/env python3
# Usage: python3 scripts/measure-slow-clients.py target/debug/shoal
# Server memory with 10 stalled readers of a 200 MiB log, and how long a 1-byte-per-second client stays connected.
import json, os, socket, subprocess, sys, time, urllib.request
exe = sys.argv[1]
d = "/tmp/shoal-measure-slow-clients/data"; subprocess.run(["rm", "-rf", d]); os.makedirs(d)
port = 47311
srv = subprocess.Popen([exe, "server", "--data-dir", d, "--listen", f"127.0.0.1:{port}"], stderr=open(d + "/../server.log", "w"))
for _ in range(100):
    if os.path.exists(f"{d}/admin.token"): break
    time.sleep(0.1)
time.sleep(0.5)
tok = open(f"{d}/admin.token").read().strip()
spec = b'name = "m"\n[train]\nmodel = "mlp"\ndataset = "digits"\nglobal_batch = 8\nsteps = 2\nlr = 0.01\n'
req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/jobs", data=spec, headers={"Authorization": f"Bearer {tok}", "Content-Type": "application/toml"})
jid = json.load(urllib.request.urlopen(req))["id"]
def state():
    r = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/jobs/{jid}", headers={"Authorization": f"Bearer {tok}"})
    return json.load(urllib.request.urlopen(r))["state"]
for _ in range(600):
    if state() in ("succeeded", "failed"): break
    time.sleep(0.2)
log = f"{d}/jobs/{jid}/attempt-1/rank-0.log"
with open(log, "ab") as f:
    chunk = b"x" * 1023 + b"\n"
    for _ in range(200 * 1024): f.write(chunk)
def rss(pid, key):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith(key): return int(l.split()[1]) // 1024
before = rss(srv.pid, "VmRSS:")
socks = []
for i in range(10):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(f"GET /api/v1/jobs/{jid}/logs?rank=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tok}\r\n\r\n".encode())
    s.recv(1024)
    socks.append(s)
time.sleep(5)
peak = rss(srv.pid, "VmHWM:")
now = rss(srv.pid, "VmRSS:")
print(json.dumps({"log_mib": os.path.getsize(log) >> 20, "readers": 10, "rss_before_mib": before, "rss_with_stalled_readers_mib": now, "peak_rss_mib": peak}))
for s in socks: s.close()
# A client that sends one header byte a second.
s = socket.create_connection(("127.0.0.1", port)); s.settimeout(1.0)
t0 = time.time(); msg = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
closed = None
for b in msg:
    try:
        s.send(bytes([b]))
        data = s.recv(100)
        if data == b"" or data: closed = time.time() - t0; break
    except socket.timeout:
        pass
    except OSError:
        closed = time.time() - t0; break
    if time.time() - t0 > 90: break
print(json.dumps({"slow_client_connected_s": round(closed, 1) if closed else "still open after 90 s"}))
srv.terminate(); srv.wait()
