"""Seeded sample-length workloads for planner tests, benchmarks and the command line.

Every generator is a pure function of its arguments (``numpy.random.default_rng(seed)``) and
returns an int64 array of lengths >= 1.  `WORKLOADS` maps a command-line name to a generator
with sensible defaults, called as ``WORKLOADS[name](n=..., seed=..., **overrides)``.
"""

from __future__ import annotations

import functools
import zlib
import logging
import os
from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np

__all__ = [
    "lognormal", "rl_prompt_response", "bimodal", "short_tail", "short_reasoning", "pareto", "rl_grouped",
    "wikipedia", "read_lengths",
    "WORKLOADS", "get_workload", "WIKIPEDIA_ENV",
]

logger = logging.getLogger(__name__)

WIKIPEDIA_ENV = "HDP_WIKIPEDIA_LENGTHS"
"""Environment variable naming the wikipedia document-length file."""


def _check(n: int, seed: int, **positive: float) -> np.random.Generator:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"workload n={n!r}: must be an integer >= 1 (number of samples)")
    for name, value in positive.items():
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"workload {name}={value!r}: must be a number > 0")
    return np.random.default_rng(seed)


def _lognormal_draw(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    # lognormal with E[X] = mean: mu = log(mean) - sigma^2 / 2
    mu = np.log(mean) - 0.5 * sigma * sigma
    return rng.lognormal(mu, sigma, n)


def _as_lengths(x: np.ndarray, max_len: int) -> np.ndarray:
    return np.clip(np.rint(x), 1, max_len).astype(np.int64)


def lognormal(
    n: int, mean: float = 2048.0, sigma: float = 1.2, max_len: int = 32_768, seed: int = 0
) -> np.ndarray:
    """n lengths from a lognormal with expectation ``mean`` (before clipping to [1, max_len])."""
    rng = _check(n, seed, mean=mean, sigma=sigma, max_len=max_len)
    return _as_lengths(_lognormal_draw(rng, mean, sigma, n), max_len)


def rl_prompt_response(
    n: int,
    prompt_mean: float = 1024.0,
    response_mean: float = 6144.0,
    response_cap: int = 16_384,
    seed: int = 0,
    *,
    prompt_sigma: float = 0.6,
    response_sigma: float = 0.9,
    prompt_cap: int = 4096,
) -> np.ndarray:
    """RL rollouts: prompt (lognormal, capped) + response (lognormal, capped at ``response_cap``).

    With ``response_mean`` a sizeable fraction of the cap, many responses hit the cap, as
    truncated RL rollouts do; the longest sample is ``prompt_cap + response_cap``.
    """
    rng = _check(
        n, seed, prompt_mean=prompt_mean, response_mean=response_mean, response_cap=response_cap,
        prompt_sigma=prompt_sigma, response_sigma=response_sigma, prompt_cap=prompt_cap,
    )
    prompt = _as_lengths(_lognormal_draw(rng, prompt_mean, prompt_sigma, n), int(prompt_cap))
    response = _as_lengths(_lognormal_draw(rng, response_mean, response_sigma, n), int(response_cap))
    return prompt + response


def bimodal(
    n: int,
    short_mean: float = 1024.0,
    long_mean: float = 16_384.0,
    long_frac: float = 0.05,
    max_len: int = 32_768,
    seed: int = 0,
    *,
    sigma: float = 0.5,
) -> np.ndarray:
    """A mix of short samples and a fraction ``long_frac`` of long ones (two lognormals)."""
    rng = _check(n, seed, short_mean=short_mean, long_mean=long_mean, max_len=max_len, sigma=sigma)
    if not 0.0 <= long_frac <= 1.0:
        raise ValueError(f"workload long_frac={long_frac!r}: must be in [0, 1]")
    is_long = rng.random(n) < long_frac
    short = _lognormal_draw(rng, short_mean, sigma, n)
    long = _lognormal_draw(rng, long_mean, sigma, n)
    return _as_lengths(np.where(is_long, long, short), max_len)


def short_tail(
    n: int,
    mean: float = 1536.0,
    tail_frac: float = 0.01,
    max_len: int = 32_768,
    seed: int = 0,
    *,
    sigma: float = 0.8,
) -> np.ndarray:
    """Short samples (lognormal, expectation ``mean``) with a thin tail reaching ``max_len``.

    A fraction ``tail_frac`` is log-uniform in [4 * mean, max_len] and the longest sample is set
    to ``max_len`` (a batch whose context-length sample decides a static CP size, as in Ascend's
    short-tail HDP experiments).
    """
    rng = _check(n, seed, mean=mean, max_len=max_len, sigma=sigma)
    if not 0.0 <= tail_frac <= 1.0:
        raise ValueError(f"workload tail_frac={tail_frac!r}: must be in [0, 1]")
    bulk = _lognormal_draw(rng, mean, sigma, n)
    lo = min(4.0 * mean, float(max_len))
    tail = np.exp(rng.uniform(np.log(lo), np.log(max_len), n))
    out = _as_lengths(np.where(rng.random(n) < tail_frac, tail, bulk), max_len)
    out[int(rng.integers(n))] = max_len
    return out


def short_reasoning(
    n: int,
    median: float = 1105.0,
    tail_frac: float = 0.03,
    max_len: int = 32_768,
    seed: int = 0,
    *,
    sigma: float = 0.7,
) -> np.ndarray:
    """Short reasoning traces with a long tail: a lognormal bulk of median ``median`` and a fraction
    ``tail_frac`` log-uniform in [4 * median, max_len] (chains of thought that ran long).  At the
    defaults a 1,024-sample batch spans ~100 to ~32K tokens with a median near 1.1K."""
    rng = _check(n, seed, median=median, max_len=max_len, sigma=sigma)
    if not 0.0 <= tail_frac <= 1.0:
        raise ValueError(f"workload tail_frac={tail_frac!r}: must be in [0, 1]")
    bulk = rng.lognormal(np.log(median), sigma, n)
    lo = min(4.0 * median, float(max_len))
    tail = np.exp(rng.uniform(np.log(lo), np.log(max_len), n))
    return _as_lengths(np.where(rng.random(n) < tail_frac, tail, bulk), max_len)


def pareto(n: int, scale: float = 512.0, alpha: float = 1.3, max_len: int = 32_768, seed: int = 0) -> np.ndarray:
    """Pareto lengths: ``scale * U**(-1 / alpha)`` (the shortest is ``scale``), clipped to ``max_len``;
    alpha near 1 puts most of the attention work in the few longest samples."""
    rng = _check(n, seed, scale=scale, alpha=alpha, max_len=max_len)
    return _as_lengths(scale * (1.0 - rng.random(n)) ** (-1.0 / alpha), max_len)


def rl_grouped(
    n: int,
    group: int = 16,
    prompt_mean: float = 512.0,
    response_median: float = 2048.0,
    max_len: int = 32_768,
    seed: int = 0,
    *,
    difficulty_sigma: float = 0.7,
    response_sigma: float = 0.5,
    tail_alpha: float = 4.0,
) -> np.ndarray:
    """RL rollouts with ``group`` responses per prompt (GRPO-style): every response of a prompt
    shares its prompt length (lognormal) and a per-prompt difficulty (lognormal, sigma
    ``difficulty_sigma``) that scales its response lengths; each response is then lognormal
    (``response_sigma``) times a Pareto(``tail_alpha``) factor -- a heavy tail of runaway responses
    -- clipped to ``max_len`` with its prompt."""
    rng = _check(n, seed, group=group, prompt_mean=prompt_mean, response_median=response_median,
                 max_len=max_len, difficulty_sigma=difficulty_sigma, response_sigma=response_sigma,
                 tail_alpha=tail_alpha)
    prompts = -(-n // int(group))
    prompt = _as_lengths(_lognormal_draw(rng, prompt_mean, 0.6, prompts), 4096)
    difficulty = rng.lognormal(0.0, difficulty_sigma, prompts)
    response = (response_median * np.repeat(difficulty, group)[:n] * rng.lognormal(0.0, response_sigma, n)
                * (1.0 - rng.random(n)) ** (-1.0 / tail_alpha))
    return _as_lengths(np.repeat(prompt, group)[:n] + response, max_len)


def _default_wikipedia_path() -> Path:
    env = os.environ.get(WIKIPEDIA_ENV)
    if env:
        return Path(env)
    bundled = Path(__file__).resolve().parent / "data" / "wikipedia_doc_lengths.txt.gz"  # 1M documents
    if bundled.is_file():
        return bundled
    raise ValueError(
        f"wikipedia: the bundled document-length file {bundled} is missing (a broken install?); set "
        f"{WIKIPEDIA_ENV}=/path/to/wikipedia_doc_lengths.txt or pass path="
    )


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime: float) -> np.ndarray:
    arr = read_lengths(path)
    arr.setflags(write=False)
    return arr


def wikipedia(n: int, max_len: int = 32_768, seed: int = 0, path: str | os.PathLike | None = None) -> np.ndarray:
    """n document lengths sampled (with replacement) from the wikipedia length file, clipped to max_len.

    ``path`` defaults to ``$HDP_WIKIPEDIA_LENGTHS``, else the 1M-document file bundled with the package
    (``hdp/packing/data/wikipedia_doc_lengths.txt.gz``).
    """
    rng = _check(n, seed, max_len=max_len)
    p = Path(path) if path is not None else _default_wikipedia_path()
    if not p.is_file():
        raise ValueError(f"wikipedia: path={str(p)!r} is not a file; pass the document-length file")
    pool = _load_cached(str(p.resolve()), p.stat().st_mtime)
    if pool.size == 0:
        raise ValueError(f"wikipedia: {p} holds no lengths")
    idx = rng.integers(0, pool.size, n)
    return np.clip(pool[idx], 1, max_len).astype(np.int64)


MAX_SAMPLES = 10_000_000
"""Most samples a workload draws or a lengths file holds (a million plan in seconds; ten billion need 75 GB)."""

MAX_LENGTHS_BYTES = 256 << 20
"""Most bytes of a lengths file read, counted after gzip's unpacking (256 MiB: ten million lengths of up to
2^40 take at most 140 MB with their newlines)."""


def read_lengths(path: str | os.PathLike, *, max_samples: int = MAX_SAMPLES,
                 max_bytes: int = MAX_LENGTHS_BYTES) -> np.ndarray:
    """Read one integer length per line (gzip when the name ends in ``.gz``); blank lines and ``#`` comments
    are skipped.

    Raises ValueError naming the line number and content of the first line that is not an integer, and
    stops reading, with a ValueError naming the cap, at the first byte past ``max_bytes`` (of the unpacked
    text) or the first length past ``max_samples``: memory stays bounded by the caps whatever the file.
    Values are not range-checked here (the planner validates them).
    """
    import gzip
    import stat as stat_module
    from array import array

    p = Path(path)
    fix = "write one integer length per line"
    try:
        st = p.stat()
    except OSError as exc:
        raise ValueError(f"lengths file {str(p)!r}: cannot read it ({exc.strerror or exc})") from exc
    if not stat_module.S_ISREG(st.st_mode):
        raise ValueError(f"lengths file {str(p)!r} is not a regular file (a directory or a device); {fix}")
    packed = p.suffix == ".gz"
    too_big = (f"more than the {max_bytes:,} bytes a lengths file may have; pass at most {max_samples:,} lengths "
               "(a sample of the batch)")
    if not packed and st.st_size > max_bytes:
        raise ValueError(f"lengths file {str(p)!r} has {st.st_size:,} bytes, {too_big}")
    values = array("q")
    read, lineno, tail = 0, 0, b""
    try:
        with (gzip.open(p, "rb") if packed else p.open("rb")) as fh:
            while True:
                block = fh.read(min(1 << 20, max_bytes - read + 1))  # never more than the cap in memory
                read += len(block)
                if read > max_bytes:
                    raise ValueError(f"lengths file {str(p)!r} {'unpacks to' if packed else 'has'} {too_big}")
                data = tail + block
                if block:
                    cut = data.rfind(b"\n") + 1
                    data, tail = data[:cut], data[cut:]
                elif not data:
                    break
                else:
                    tail = b""
                lines = data.split(b"\n")
                if data.endswith(b"\n"):
                    lines.pop()
                _parse_lengths(lines, lineno, values, p, max_samples, comments=b"#" in data)
                lineno += len(lines)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"lengths file {str(p)!r}: cannot read it{' as gzip' if packed else ''} ({exc}); {fix}") from None
    return np.frombuffer(values, dtype=np.int64).copy() if values else np.zeros(0, dtype=np.int64)


def _parse_lengths(lines: list[bytes], before: int, values: Any, p: Path, max_samples: int, *,
                   comments: bool) -> None:
    """Append the lengths of ``lines`` (lines ``before + 1`` on of ``p``) to the int64 array ``values``;
    ValueError naming the first bad line, or the line past ``max_samples``."""
    if not comments:  # the fast path: plain numbers and blank lines
        try:
            nums = [int(ln) for ln in lines if ln.strip()]
            if len(values) + len(nums) <= max_samples:
                values.extend(nums)
                return
        except (ValueError, OverflowError):
            pass  # the line-by-line pass below names the line
    for i, raw in enumerate(lines, start=before + 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"lengths file {str(p)!r} line {i}: not UTF-8 text; write one integer length per "
                             "line") from None
        line = text.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            value = int(line)
        except ValueError:
            raise ValueError(f"lengths file {str(p)!r} line {i}: {text.strip()!r} is not an integer; write one "
                             "integer length per line ('#' starts a comment)") from None
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"lengths file {str(p)!r} line {i}: {value} does not fit a 64-bit integer; a length "
                             "is a token count (at most 2^40)")
        if len(values) == max_samples:
            raise ValueError(f"lengths file {str(p)!r} holds more than {max_samples:,} lengths (line {i}), the most "
                             "a batch may have; pass a sample of the batch")
        values.append(value)


WORKLOADS: dict[str, Callable[..., np.ndarray]] = {
    "lognormal": lognormal,
    "rl": rl_prompt_response,
    "rl-32k": functools.partial(rl_prompt_response, response_mean=12_288.0, response_cap=32_768),
    "bimodal": bimodal,
    "ascend-short-tail": short_tail,
    "short-reasoning": short_reasoning,
    "pareto": pareto,
    "rl-grouped": rl_grouped,
    "wikipedia": wikipedia,
}
"""Command-line name -> generator; call as ``WORKLOADS[name](n=..., seed=..., **overrides)``."""


def get_workload(name: str) -> Callable[..., np.ndarray]:
    """Look up a workload by name; raise ValueError naming the known ones."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"workload={name!r} is unknown; choose one of: {', '.join(WORKLOADS)}") from None
