"""Wire formats on real pseudo-gradients: bytes on the wire, error, and coding speed.

A pseudo-gradient is what a site averages: ``theta_global - theta_local`` after ``--steps`` inner
AdamW steps from the shared init, on real text (tinyshakespeare from ../shared when present, else the
standard library's sources). Two models: the ``tiny`` preset (1.08 M parameters) and ``small``
(~99 M, the 100M-class model of issue #5; slow on a CPU, so it gets fewer steps by default).

For each wire format it prints, against fp32 (4 bytes a value, the baseline in the same process):

* ``wire/fp32``: encoded bytes / fp32 bytes, on the whole vector in hivemind-sized parts;
* ``bits/value``;
* ``rel_err``: ||x - decode(encode(x))|| / ||x||;
* ``enc MB/s`` and ``dec MB/s``: fp32 megabytes coded per second (median of ``--repeats``);
* ``order0 bits``: the empirical entropy of the int8 codes (what any order-0 entropy coder, Huffman
  included, can reach at best), to see how close zstd's stage gets.

    python benchmarks/wire_formats.py [--models tiny small] [--steps 30 8] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PART_VALUES = 2**19  # hivemind's default part (512 KiB at the int8 estimate of one byte a value)


def pseudo_gradient(preset: str, steps: int, threads: int) -> torch.Tensor:
    """theta_0 - theta_steps of ``preset`` trained with AdamW on real text."""
    import torch

    from greenswarm.averaging.outer import flatten
    from greenswarm.node.data import DataConfig, TokenBatches
    from greenswarm.node.model import ModelConfig, build_model, causal_lm_loss
    from greenswarm.node.tokenizer import ByteTokenizer

    torch.set_num_threads(threads)
    corpus = REPO.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"
    data = DataConfig(source=str(corpus)) if corpus.exists() else DataConfig()
    model = build_model(ModelConfig(preset=preset), ByteTokenizer.vocab_size)
    start = flatten([p for p in model.parameters()])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = iter(TokenBatches(data, ByteTokenizer(), 8))
    for _ in range(steps):
        loss = causal_lm_loss(model, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return start - flatten([p for p in model.parameters()])


def order0_bits(codes: torch.Tensor) -> float:
    import torch

    counts = torch.bincount(codes.to(torch.int64) + 128, minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def measure(x: torch.Tensor, repeats: int) -> dict[str, dict[str, float]]:
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from greenswarm.averaging.codecs import WIRE_FORMATS, _int8_encode

    parts = list(x.split(PART_VALUES))
    mb = x.numel() * 4 / 1e6
    out: dict[str, dict[str, float]] = {}
    for name, fmt in WIRE_FORMATS.items():
        enc_s, dec_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            encoded = [fmt.compression.compress(p, CompressionInfo.from_tensor(p)) for p in parts]
            t1 = time.perf_counter()
            decoded = [deserialize_torch_tensor(e) for e in encoded]
            t2 = time.perf_counter()
            enc_s.append(t1 - t0)
            dec_s.append(t2 - t1)
        import torch

        y = torch.cat(decoded)
        wire = sum(len(e.buffer) for e in encoded)
        out[name] = {
            "wire/fp32": wire / (4 * x.numel()),
            "bits/value": 8 * wire / x.numel(),
            "rel_err": float((x - y).norm() / x.norm()),
            "enc MB/s": mb / statistics.median(enc_s),
            "dec MB/s": mb / statistics.median(dec_s),
        }
    codes, _ = _int8_encode(x)
    out["int8"]["order0 bits"] = order0_bits(codes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", nargs="+", type=int, default=[30, 8], help="inner steps, per model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    results = {}
    for i, preset in enumerate(args.models):
        steps = args.steps[min(i, len(args.steps) - 1)]
        t0 = time.perf_counter()
        x = pseudo_gradient(preset, steps, args.threads)
        torch.set_num_threads(1)  # coding runs on hivemind's executor threads, one part at a time
        results[preset] = {
            "numel": x.numel(),
            "steps": steps,
            "train_s": time.perf_counter() - t0,
            "formats": measure(x, args.repeats),
        }
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for preset, r in results.items():
        print(f"\n{preset}: {r['numel']:,} values, pseudo-gradient after {r['steps']} AdamW steps")
        print(
            f"{'format':<12}{'wire/fp32':>10}{'bits/val':>10}{'rel_err':>10}{'enc MB/s':>10}{'dec MB/s':>10}"
        )
        for name, m in r["formats"].items():
            print(
                f"{name:<12}{m['wire/fp32']:>10.4f}{m['bits/value']:>10.3f}{m['rel_err']:>10.2e}"
                f"{m['enc MB/s']:>10.0f}{m['dec MB/s']:>10.0f}"
            )
        print(f"int8 codes: order-0 entropy {r['formats']['int8']['order0 bits']:.3f} bits/value")


if __name__ == "__main__":
    main()
