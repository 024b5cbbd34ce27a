"""Build the compiled pickle scan once with AddressSanitizer and UBSan, and hold it to the Python scan.

Copies the package into a temporary directory and builds ``_scan.c`` there with ``-fsanitize=address,undefined``
(the checkout's own build is left as it is), then runs ``--cases`` differential cases in a child process under
``LD_PRELOAD`` of gcc's libasan (with ``PYTHONMALLOC=malloc``, so that it watches the scan's own blocks): pickles
mutated from real ones (``torch.save``'s, and ``pickle``'s in every protocol) by the fuzzer's opcode mutations
(``fuzz.pickles``) and by byte edits, and opcode streams drawn at random, each read with one of both opcode sets,
one case in four under tight limits so that every refusal is reached. Each case must end alike in both scans, the
same result or the same refusal word for word. Prints the count, the disagreements and any sanitizer report; exit
status 0 only when every case agrees and there is no report:

    python scripts/scan_sanitized.py --cases 50000 --seed 0
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer -g"
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "LeakSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")
"""What a sanitizer writes on stderr when it finds something."""
TIGHT = {"MAX_DEPTH": 6, "MAX_WEIGHT": 40, "HASH_BUDGET_BASE": 30, "MAX_LIVE": 12, "LIVE_CHECK_OPS": 3,
         "MAX_INT_BYTES": 3, "MAX_INT_DIGITS": 4}  # fmt: skip
"""The limits of ``pickle_limits`` (the integers': of ``pickle_arguments``) for the cases under tight limits."""
PLAIN = {"state": {0: {"step": 3.0, "exp_avg": [1.5, -2], "key": (1, "a", None)}}, "groups": [{"params": [0, 1]}]}
STREAM = b"N(t)l]d}s\x8f\x90\x91ae\x85\x86\x87\x94h\x00h\x01q\x01g0\np2\nRb\x81\x922012Q\x93\x8e\x85\x95KI0\nL1L\n"
"""Opcodes of every kind (with arguments where short), drawn one after another for the random streams."""


def build(where: Path) -> Path:
    """The package copied into ``where`` and its scan built there with the sanitizers; the copy's root."""
    copy = where / "checkout"
    shutil.copytree(ROOT / "optim_repair", copy / "optim_repair", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, copy / name)
    env = {**os.environ, "CFLAGS": SANITIZE, "LDFLAGS": "-fsanitize=address,undefined"}
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=copy, env=env, check=True, capture_output=True
    )
    if not list((copy / "optim_repair" / "formats").glob("_scan*.so")):
        raise SystemExit("scan_sanitized: _scan.c did not build with the sanitizers (is gcc there?)")
    return copy


def seeds() -> list[bytes]:
    """Real pickles: a ``torch.save`` of an optimizer's state dict, and plain data in every protocol."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "step": 1}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        found = [archive.read(name) for name in archive.namelist() if name.endswith("/data.pkl")]
    value = [PLAIN, PLAIN, (PLAIN, frozenset({1, b"x"}), {1, 2}, bytearray(b"ab"), 1 << 70, "é" * 20)]
    return found + [pickle.dumps(value, protocol=protocol) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)]


def _edited(rng: random.Random, data: bytes) -> bytes:
    """``data`` with a few bytes flipped, inserted, dropped, repeated or cut."""
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at, how = rng.randrange(len(mutated) + 1), rng.randrange(5)
        if how == 0 and at < len(mutated):
            mutated[at] ^= 1 << rng.randrange(8)
        elif how == 1:
            mutated[at:at] = STREAM[rng.randrange(len(STREAM))].to_bytes(1, "little") * rng.randint(1, 3)
        elif how == 2:
            del mutated[at : at + rng.randint(1, 8)]
        elif how == 3:
            mutated[at:at] = mutated[rng.randrange(len(mutated) + 1) :][: rng.randint(1, 40)]
        else:
            mutated = mutated[: max(at, 1)]
    return bytes(mutated)


def cases(count: int, seed: int, found: list[bytes]) -> Iterator[tuple[bytes, bool, bool]]:
    """``count`` cases: a pickle, whether it is read with torch's weights-only opcodes, whether under tight limits."""
    from fuzz.pickles import mutate_pickle

    rng = random.Random(seed)
    for _ in range(count):
        how = rng.randrange(4)
        if how == 3:
            data = b"".join(STREAM[i : i + 1] for i in (rng.randrange(len(STREAM)) for _ in range(rng.randint(0, 60))))
            data = b"N\x94" + data + (b"." if rng.random() < 0.8 else b"")
        else:
            data = rng.choice(found)
            for _ in range(rng.randint(1, 3)):
                data = mutate_pickle(rng, data)[0] if how < 2 else _edited(rng, data)
        yield data, rng.random() < 0.5, rng.random() < 0.25


def child(count: int, seed: int, seeds_file: Path) -> int:
    """Run the cases here (under the sanitizers): print what disagreed, as JSON; exit 0."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from optim_repair.formats import pickle_arguments, pickle_limits
    from optim_repair.formats.pickle_opcodes import PICKLE, WEIGHTS_ONLY

    if pickle_limits._compiled is None:
        raise SystemExit("scan_sanitized: the sanitized _scan.c did not import")
    if "libasan" not in Path("/proc/self/maps").read_text():
        raise SystemExit("scan_sanitized: AddressSanitizer's runtime is not loaded")
    homes = {name: pickle_arguments if name.startswith("MAX_INT") else pickle_limits for name in TIGHT}
    limits = {name: getattr(homes[name], name) for name in TIGHT}

    def outcome(scan: Any, data: Any, allowed: Any) -> str:
        try:
            return repr(scan(data, 0, allowed))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    found = [text.encode("latin-1") for text in json.loads(seeds_file.read_text())]
    disagreed, disagreements = [], 0
    for data, weights_only, tight in cases(count, seed, found):
        allowed = WEIGHTS_ONLY if weights_only else PICKLE
        for name, value in (TIGHT if tight else limits).items():
            setattr(homes[name], name, value)
        python = outcome(pickle_limits.scan_python, data, allowed)
        compiled = outcome(pickle_limits.scan_compiled, bytearray(data), allowed)
        if compiled != python:
            disagreements += 1
            if len(disagreed) < 20:
                disagreed.append({"data": data.hex()[:2000], "python": python, "compiled": compiled, "tight": tight})
    scanner = str(Path(pickle_limits._compiled.__file__ or "").resolve())
    print(json.dumps({"cases": count, "disagreements": disagreements, "disagreed": disagreed, "scanner": scanner}))
    return 0


def run(count: int, seed: int) -> tuple[dict[str, Any], list[str]]:
    """Build, then run the cases in a sanitized child: what it printed, and the sanitizer's report lines."""
    with tempfile.TemporaryDirectory(prefix="scan-sanitized-") as temporary:
        where = Path(temporary)
        copy = build(where)
        seeds_file = where / "seeds.json"
        seeds_file.write_text(json.dumps([data.decode("latin-1") for data in seeds()]))
        libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
        env = {
            **os.environ,
            "PYTHONPATH": str(copy),
            "LD_PRELOAD": libasan.stdout.strip(),
            "ASAN_OPTIONS": "detect_leaks=0",
            "PYTHONMALLOC": "malloc",  # PyMem_Malloc by malloc, which AddressSanitizer watches (not pymalloc's pools)
            "UBSAN_OPTIONS": "print_stacktrace=1",
            "OPTIM_REPAIR_PURE_PYTHON": "0",
        }
        command = [sys.executable, str(Path(__file__).resolve()), "--child", str(seeds_file)]
        result = subprocess.run(
            [*command, "--cases", str(count), "--seed", str(seed)], env=env, cwd=where, capture_output=True, text=True
        )
    reports = [line for line in result.stderr.splitlines() if any(report in line for report in REPORTS)]
    if result.returncode != 0 and not reports:
        reports = [f"the child exited {result.returncode}: {result.stderr[-2000:]}"]
    if result.returncode != 0:
        return {"cases": 0, "disagreements": 0, "disagreed": [], "scanner": ""}, reports
    printed = json.loads(result.stdout.splitlines()[-1])
    if not printed["scanner"].startswith(str(copy.resolve())):
        raise SystemExit(f"scan_sanitized: the child scanned with {printed['scanner']}, not the sanitized build")
    return printed, reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.cases, args.seed, args.child)
    printed, reports = run(args.cases, args.seed)
    for case in printed["disagreed"]:
        print(f"disagree: {json.dumps(case)}")
    for line in reports:
        print(f"sanitizer: {line}")
    agreed = printed["cases"] - printed["disagreements"]
    print(f"{printed['cases']} cases, {agreed} agree, {len(reports)} sanitizer report lines")
    return 0 if printed["cases"] == args.cases and agreed == args.cases and not reports else 1


if __name__ == "__main__":
    sys.exit(main())
