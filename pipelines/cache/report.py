"""`inspect` and `verify` of activation caches: the manifest in human terms, and integrity plus recomputation.

    describe(path) -> list[dict]            one dict per store (a cache directory's splits, or the single store)
    format_description(info) -> str
    verify_cache(path, staged=None, datasets=None, tokenizer=None, samples=8, seed=0) -> list[StoreCheck]
        every shard's integrity (storage.verify); with a model and data, the store's fingerprint against them and
        `samples` randomly chosen samples recomputed (batch of one) and compared with what is stored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pipelines.data.batches import TokenSamples
from preinfer.staged import StagedModel
from storage import Store, StorageError, disk_bytes, location, open_store, verify
from pipelines.cache.directory import CACHE_INDEX, cache_splits, listed_splits_missing, read_index
from pipelines.cache.fingerprints import cache_fingerprint
from pipelines.cache.shards import DatasetInputs


def _real_tokens(store: Store, done: list[int]) -> int | None:
    if store.format == "safetensors":
        return None  # would read every file whole; the cache index has the count
    return sum(int(store.read_shard(i, ["attention_mask"], check=False)["attention_mask"].sum()) for i in done)


def describe(path: str | os.PathLike) -> list[dict[str, Any]]:
    """What `preinfer inspect` shows, per store."""
    path = location(path)
    found = cache_splits(path)
    if not found:
        raise StorageError(f"no activation store or cache directory at {path} (no manifest.json there or in its "
                           f"subdirectories)")
    index = read_index(path)
    infos = []
    for split, store_path in found.items():
        store = open_store(store_path, check_files=False)
        manifest = store.manifest
        done = store.completed_shards()
        size = store.size_info()
        seq_len = store.fields["hidden"].shape[0] if "hidden" in store.fields else None
        real = index.get("splits", {}).get(split, {}).get("tokens") if split else None
        if real is None:
            real = _real_tokens(store, done) if done and "attention_mask" in store.fields else None
        infos.append({
            "split": split, "path": str(store_path), "status": _status(store.num_shards, len(done), manifest),
            "format": store.format, "codec": store.codec,
            "samples": store.num_samples, "seq_len": seq_len,
            "tokens": store.num_samples * seq_len if seq_len else None, "real_tokens": real,
            "written_tokens": _written_samples(store, done) * seq_len if seq_len else None,
            "shards": store.num_shards, "samples_per_shard": store.samples_per_shard,
            "complete_shards": len(done), "missing_shards": store.num_shards - len(done),
            "finalized": bool(manifest.get("complete")),
            "fields": {n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in store.fields.items()},
            "raw_bytes": size["raw_bytes"], "stored_bytes": size["stored_bytes"], "disk_bytes": disk_bytes(store_path),
            "compression_ratio": size["ratio"], "fingerprint": store.fingerprint.to_json(),
            "created": manifest.get("created"), "tool": manifest.get("tool"),
            "encodings": {name: {**manifest["encodings"][name], **_error_summary(stats)}
                          for name, stats in store.encoding_error().items()},
        })
    return infos


def _written_samples(store: Store, done: list[int]) -> int:
    """The samples in the complete shards `done` (the last shard may hold fewer)."""
    per = store.samples_per_shard
    return sum(min(per, store.num_samples - index * per) for index in done)


def _status(shards: int, complete: int, manifest: dict[str, Any]) -> str:
    if complete < shards:
        return f"INCOMPLETE: {shards - complete} of {shards} shards missing (resume the cache job)"
    if not manifest.get("complete"):
        return "all shards written, not finalized (rerun the cache job to finalize)"
    return "complete"


def _error_summary(stats: dict[str, float]) -> dict[str, float]:
    """The decoding error of a lossy field as inspect reports it."""
    return {"rms_rel": stats["rms_rel"], "max_abs": stats["max_abs"], "max_over_bound": stats["max_over_bound"]}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_description(info: dict[str, Any]) -> str:
    codec = info["codec"]
    codec_text = codec.get("name", "?") + (f" level {codec['level']}" if codec.get("name") != "none" else "")
    tokens = f"{info['tokens']:,}" if info["tokens"] is not None else "?"
    if info["real_tokens"] is not None:
        real, written = info["real_tokens"], info.get("written_tokens", info["tokens"])
        if written != info["tokens"]:
            tokens += (f" ({real:,} real and {written - real:,} padding in the {info['complete_shards']} complete "
                       f"shards; {info['tokens'] - written:,} not written yet)")
        else:
            tokens += " (all real, no padding)" if real == info["tokens"] else f" ({real:,} real, the rest padding)"
    ratio = f"{info['compression_ratio']:.2f}x" if info["compression_ratio"] else "-"
    lines = [
        f"{info['split'] + ': ' if info['split'] else ''}{info['path']}",
        f"  status        {info['status']}",
        f"  samples       {info['samples']:,} of {info['seq_len']} tokens, in {info['shards']} shards of "
        f"{info['samples_per_shard']} ({info['complete_shards']} complete)",
        f"  tokens        {tokens}",
        f"  format        {info['format']}, codec {codec_text}",
        "  fields        " + ", ".join(f"{n} {s['shape']} {s['dtype']}" for n, s in info["fields"].items()),
        f"  size          {_mib(info['raw_bytes'])} raw, {_mib(info['stored_bytes'])} stored "
        f"({_mib(info['disk_bytes'])} on disk), compression {ratio}",
    ]
    lines += [f"  encoding      {name}: {e['codes']} codes x {e['scale']}, relative RMS error {e['rms_rel']:.4g}, max "
              f"abs error {e['max_abs']:.4g} ({e['max_over_bound']:.3f} of the bound)"
              for name, e in info["encodings"].items()]
    lines += [f"  fingerprint   {info['fingerprint']['digest']}"]
    lines += [f"    {key:<12}{value}" for key, value in info["fingerprint"]["parts"].items()]
    return "\n".join(lines)


@dataclass
class StoreCheck:
    """The outcome of verifying one store."""

    split: str
    path: str
    integrity: str  # storage.verify's report
    integrity_ok: bool
    fingerprint_problem: str | None = None
    samples: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    bit_exact: int = 0

    @property
    def ok(self) -> bool:
        return self.integrity_ok and self.fingerprint_problem is None and not self.mismatches

    def __str__(self) -> str:
        lines = [self.integrity]
        if self.fingerprint_problem:
            lines.append(f"  STALE: {self.fingerprint_problem}")
        if self.samples:
            verdict = "OK" if not self.mismatches else "MISMATCH"
            lines.append(f"  recomputed {len(self.samples)} samples {self.samples[:12]}"
                         f"{' ...' if len(self.samples) > 12 else ''}: {verdict}, {self.bit_exact} bit-exact, max "
                         f"abs difference {self.max_abs_diff:.3g}")
            lines += [f"    {m}" for m in self.mismatches[:10]]
        return "\n".join(lines)


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol relative to the sample's largest value) for a recomputed sample in batch of one."""
    return (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)


def _matching_dataset(store: Store, datasets: Mapping[str, TokenSamples], split: str) -> TokenSamples | None:
    if split in datasets:
        return datasets[split]
    wanted = store.fingerprint.parts.get("dataset")
    return next((d for d in datasets.values() if d.fingerprint() == wanted), None)


def verify_cache(path: str | os.PathLike, staged: StagedModel | None = None,
                 datasets: Mapping[str, TokenSamples] | None = None, tokenizer: Any = None, samples: int = 8,
                 seed: int = 0, device: str | torch.device = "cpu") -> list[StoreCheck]:
    found = cache_splits(path)
    if not found:
        raise StorageError(f"no activation store or cache directory at {path}")
    checks = [StoreCheck(split, str(store_path), f"{split}: MISSING: {CACHE_INDEX} lists this split, but "
                                                 f"{store_path} holds no store manifest", False)
              for split, store_path in listed_splits_missing(path, found).items()]
    for split, store_path in found.items():
        report = verify(store_path)
        check = StoreCheck(split, str(store_path), f"{split + ': ' if split else ''}{report}", report.ok)
        checks.append(check)
        if staged is None or report.manifest_error:
            continue
        store = open_store(store_path, check_files=False)
        parts = store.fingerprint.parts
        dataset = _matching_dataset(store, datasets or {}, split)
        if dataset is None:
            check.fingerprint_problem = "none of the given data splits has the content this store was made from"
            continue
        boundary, dtype = int(parts.get("boundary", 0)), str(parts.get("dtype", "auto"))
        if not 1 <= boundary <= staged.num_layers:
            check.fingerprint_problem = f"boundary {boundary} is outside the model's [1, {staged.num_layers}]"
            continue
        expected = cache_fingerprint(staged, dataset, tokenizer, boundary, dtype, str(parts.get("model", "")))
        if expected.digest != store.fingerprint.digest:
            check.fingerprint_problem = ("built for another model, data or settings: "
                                         + "; ".join(store.fingerprint.differences(expected)))
        _recompute(check, store, staged, dataset, boundary, samples, seed, device)
    return checks


def _recompute(check: StoreCheck, store: Store, staged: StagedModel, dataset: TokenSamples, boundary: int,
               samples: int, seed: int, device) -> None:
    if len(dataset) != store.num_samples or dataset.seq_len != store.fields["hidden"].shape[0]:
        check.mismatches.append(f"the data has {len(dataset)} samples of {dataset.seq_len} tokens, the store "
                                f"{store.num_samples} of {store.fields['hidden'].shape[0]}")
        return
    done = set(store.completed_shards())
    candidates = [i for i in range(store.num_samples) if i // store.samples_per_shard in done]
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(candidates), generator=generator)[:samples].tolist()
    check.samples = sorted(candidates[j] for j in order)
    inputs = DatasetInputs(staged, dataset, device)
    was_training = staged.model.training
    staged.model.eval()
    try:
        with torch.inference_mode():
            for i in check.samples:
                shard = i // store.samples_per_shard
                offset = i - store.shard_range(shard)[0]
                stored = {k: v[offset:offset + 1] for k, v in store.read_shard(shard).items()}
                fresh = staged.run(inputs(i, i + 1), 0, boundary).to_dict()
                fresh = {k: v.cpu() for k, v in fresh.items()}
                allowance = _encoding_allowance(store, stored)
                stored = store.decode(stored, torch.float32)
                fresh["hidden"] = fresh["hidden"].to(stored["hidden"].dtype)
                _compare(check, i, stored, fresh, staged.compute_dtype, allowance)
    finally:
        staged.model.train(was_training)


def _encoding_allowance(store: Store, stored: dict[str, torch.Tensor]) -> torch.Tensor | float:
    """What a lossy encoding may add to the difference of each stored value (its bound x the row's scale); 0.0
    for an exact store."""
    encoding = store.encodings.get("hidden")
    return 0.0 if encoding is None else encoding.bound * stored["hidden_scale"].float().unsqueeze(-1)


def _compare(check: StoreCheck, i: int, stored: dict, fresh: dict, compute_dtype: torch.dtype,
             allowance: torch.Tensor | float) -> None:
    """Record sample `i`'s differences between stored and recomputed states: exact stores within the recompute
    tolerance of their dtype, lossy ones within it plus the encoding's bound."""
    problems = [f"sample {i}: {name} differs" for name in ("attention_mask", "position_ids", "labels")
                if name in stored and not torch.equal(stored[name], fresh[name].to(stored[name].dtype))]
    a, b = stored["hidden"].float(), fresh["hidden"].float()
    if torch.equal(stored["hidden"], fresh["hidden"]):
        check.bit_exact += 1
    else:
        diff = (a - b).abs()
        scale = max(float(b.abs().max()), 1e-30)
        rtol, atol = _tolerance(compute_dtype if isinstance(allowance, torch.Tensor) else stored["hidden"].dtype)
        worst = float(diff.max())
        check.max_abs_diff = max(check.max_abs_diff, worst)
        if not bool((diff <= allowance + atol * scale + rtol * b.abs()).all()) or not bool(torch.isfinite(a).all()):
            problems.append(f"sample {i}: hidden states differ by up to {worst:.3g} (largest value {scale:.3g})")
    check.mismatches += problems
