"""One real node through the whole stack: `gpuorch up` with no simulated nodes, one `gpuorch agent` that
discovers this machine's GPUs with NVML, and a job that runs CUDA on one of them.

    python -m bench.realgpu [--backend nvml|simulated] [--json FILE]

Prints what discovery reported (model, memory, MIG, NVLink domains, health), the job's states and its log,
and the GPU telemetry the health service exported. Exit 0 only if the job succeeded on a GPU the agent
reported. `--backend simulated` runs the same path here, on a fake `l4-8x` node, without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shared.natsd import NatsServer, free_port

CUDA = ("import os, torch; x = torch.ones(4096, 4096, device='cuda'); torch.cuda.synchronize(); "
        "print('device', torch.cuda.get_device_name(0), 'visible', os.environ['CUDA_VISIBLE_DEVICES'], "
        "'sum', float((x @ x).sum()))")
NO_CUDA = "import os; print('visible', os.environ['CUDA_VISIBLE_DEVICES'])"


def poll(what: str, fn, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"realgpu: timed out waiting for {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nvml", "simulated"), default="nvml")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--task-python", help="the task's interpreter (a root agent runs it as nobody: it must be "
                                          "reachable by that account); default: this one for nvml, "
                                          "/usr/bin/python3 for simulated")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpuorch-realgpu-"))
    root.chmod(0o755)  # a root agent runs the task as its owner's account, which must reach its work dir
    data, port, agent_port = root / "stack", free_port(), free_port()
    nats = NatsServer(root / "nats").start()
    procs: list[subprocess.Popen] = []
    out: dict = {"backend": args.backend}
    ok = False
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(root / "up.log", "w") as up_log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--nats", nats.url, "--port", str(port), "--data-dir",
                 str(data), "--nodes", ""], stdout=up_log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        agent = [sys.executable, "-m", "services.cli", "agent", "--backend", args.backend, "--node-id", "gpu-node-0",
                 "--nats", nats.url, "--port", str(agent_port), "--work-dir", str(root / "agent")]
        if args.backend == "simulated":
            agent += ["--profile", "l4-8x"]
        with open(root / "agent.log", "w") as agent_log:
            procs.append(subprocess.Popen(agent, stdout=agent_log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        token = poll("the admin token", lambda: (data / "auth" / "admin.token").is_file() and
                     (data / "auth" / "admin.token").read_text().strip())
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                           timeout=10)

        def ready():
            try:
                return api.get("/readyz").status_code == 200
            except httpx.HTTPError:
                return False

        poll("/readyz", ready)
        node = poll("the node's registration", lambda: next(
            (n for n in api.get("/v1/nodes").json() if n["id"] == "gpu-node-0"), None))
        out["node"] = node
        for g in node["gpus"]:
            print(f"gpu {g['index']}: {g['model']} {g['memory_mib']} MiB cc={g['compute_capability']} "
                  f"uuid={g['uuid']} healthy={g['healthy']} ecc={g['ecc_enabled']} mig={g['mig_enabled']} "
                  f"slices={len(g['mig_slices'])} nvlink={g['nvlink_domain'] or '-'} bus={g['pci_bus_id']}")
        code = CUDA if args.backend == "nvml" else NO_CUDA
        python = args.task_python or (sys.executable if args.backend == "nvml" else "/usr/bin/python3")
        r = api.post("/v1/jobs", json={"name": "cuda-check", "resources": {"gpus": 1},
                                       "command": [python, "-c", code]})
        r.raise_for_status()
        job_id = r.json()["id"]
        job = poll("the job's end", lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["state"] in
                   ("succeeded", "failed", "cancelled") and j, deadline_s=120)
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
        out["job"], out["logs"] = job, logs
        print(f"job {job_id}: {job['state']} on {job.get('placement') or job.get('tasks')}")
        print("log:", logs.strip())
        time.sleep(2.5)  # two telemetry intervals, for the health service's gauges
        metrics = [line for line in api.get("/metrics").text.splitlines()
                   if line.startswith("DCGM_FI_DEV_") and 'gpu="0"' in line]
        out["telemetry"] = metrics
        print("\n".join(metrics[:12]))
        gpus = {g["uuid"] for g in node["gpus"]}
        ok = job["state"] == "succeeded" and any(u in logs for u in gpus)
        print("realgpu:", "OK" if ok else "FAILED", f"({args.backend})")
        return 0 if ok else 1
    finally:
        for p in reversed(procs):
            if p.pid > 1 and p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        nats.stop()
        if args.json:
            args.json.write_text(json.dumps(out, indent=2, default=str))
        for name in ("up.log", "agent.log"):
            if not ok or os.environ.get("REALGPU_SHOW_LOGS"):
                print(f"--- {name}\n" + (root / name).read_text()[-4000:])


if __name__ == "__main__":
    sys.exit(main())
