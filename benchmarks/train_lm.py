"""examples/train_lm.py on the present device: flashjax vs Flax's default attention.

    python benchmarks/train_lm.py                                # the standard grid
    python benchmarks/train_lm.py --seqlens 2048,8192 --steps 10

Each (attention, T) runs in its own process, so one run's out-of-memory or its
allocator's high-water mark never leaks into the next. The model is the example's
decoder-only LM at a realistic width (d_model 1024, 8 heads of 128, bf16) with the
same number of tokens per step at every T (batch = tokens // T), so tokens/s compare
across lengths. Prints a table and writes benchmarks/results/train_lm-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flashjax import benchmark  # noqa: E402  (results files and error kinds; nothing here touches a device)

RESULTS_DIR = ROOT / "benchmarks" / "results"
MODEL = ["--d-model", "1024", "--heads", "8", "--layers", "4", "--dtype", "bfloat16", "--vocab", "64", "--lr", "1e-3"]


def run_one(attention: str, seq: int, tokens: int, steps: int, timeout: float) -> dict:
    batch = max(1, tokens // seq)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--attention", attention,
               "--seq-len", str(seq), "--batch", str(batch), "--steps", str(steps), "--no-progress",
               "--out", str(out), *MODEL]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"attention": attention, "seq": seq, "batch": batch, "status": "timeout"}
        if out.exists():
            summary = json.loads(out.read_text())
            summary.update(seq=seq, batch=batch, status="oom" if summary.get("oom") else "ok")
            return summary
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        oom = benchmark.is_oom(RuntimeError(proc.stderr))
        return {"attention": attention, "seq": seq, "batch": batch, "status": "oom" if oom else "error",
                "error": " | ".join(tail)[:400]}


def table(rows: list[dict]) -> str:
    lines = ["attention  T       batch  status  tokens/s     step ms   peak GiB  loss first -> last"]
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"{r['attention']:<10} {r['seq']:<7} {r['batch']:<6} ok      {r['tokens_per_s']:>11,.0f}  "
                f"{r['median_step_s'] * 1e3:8.1f}  {(r.get('peak_memory_bytes') or 0) / 2**30:8.2f}  "
                f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
        else:
            lines.append(f"{r['attention']:<10} {r['seq']:<7} {r['batch']:<6} {r['status']:<7} {r.get('error', '')[:80]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", default="2048,8192,16384,32768")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per training step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    p.add_argument("--out", default=None, help="results .json or directory (default benchmarks/results/train_lm-<device>.json)")
    args = p.parse_args(argv)

    rows = []
    for seq in (int(s) for s in args.seqlens.split(",")):
        for attention in ("flash", "flax"):
            rows.append(run_one(attention, seq, args.tokens, args.steps, args.timeout))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    device = next((r["device"] for r in rows if "device" in r), "unknown")
    path = benchmark.results_path(RESULTS_DIR, args.out, device, prefix="train_lm-")
    record = {"device": device, "date": datetime.date.today().isoformat(), "model": " ".join(MODEL),
              "tokens_per_step": args.tokens, "steps": args.steps, "rows": rows}
    benchmark.save_results(path, record)
    print(f"\n{table(rows)}\n\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
