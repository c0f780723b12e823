"""Every `#pragma omp simd` loop of the ONNX Runtime CPU kernels vectorises when compiled as the library is
(runtime/ort_kernels.py `compiler_command`): g++'s vectoriser report names a vectorised loop inside each. A
loop that falls back to scalar code still computes the right values, so only this catches it (without
-fno-trapping-math no loop holding exp_approx's clamp vectorised, and the SiTU-GLU ran ~20x slower)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ort_kernel_models import skip_without_ort_headers

PRAGMA = re.compile(r"^\s*#pragma omp simd\b")


def simd_loops(source: Path) -> list[tuple[int, int]]:
    """(first, last) 1-based lines of the loop after each `#pragma omp simd`: the `for` line through the line
    closing its braces, or, for a loop without braces, through the line ending its one statement."""
    lines, loops = source.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if not PRAGMA.match(line):
            continue
        first = last = i + 1  # 0-based index of the for line
        if "{" in lines[first]:
            depth = lines[first].count("{") - lines[first].count("}")
            while depth > 0:
                last += 1
                depth += lines[last].count("{") - lines[last].count("}")
        else:
            while not lines[last].rstrip().endswith(";"):
                last += 1
        loops.append((first + 1, last + 1))
    return loops


def vectorised_lines(source: Path, command: list[str], headers: list[Path]) -> tuple[set[int], list[set[int]]]:
    """The lines of the vectorised loops g++ reports in `source` and in each of the shared `headers`."""
    r = subprocess.run([*command, "-c", str(source), "-o", "/dev/null", "-fopt-info-vec-optimized"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    found = [{int(n) for n in re.findall(rf"^{re.escape(str(f))}:(\d+):\d+: optimized: loop vectorized",
                                         r.stderr, re.M)} for f in (source, *headers)]
    return found[0], found[1:]


def test_the_loop_finder_reads_both_loop_forms(tmp_path):
    src = tmp_path / "k.cc"
    src.write_text("void f(float* y) {\n#pragma omp simd\n  for (int i = 0; i < 8; ++i) y[i] = 1.f;\n"
                   "#pragma omp simd reduction(+ : s)\n  for (int i = 0; i < 8; ++i) {\n    s += y[i];\n  }\n"
                   "#pragma omp simd\n  for (int i = 0; i < 8; ++i)\n    y[i] = 2.f;\n}\n")
    assert simd_loops(src) == [(3, 3), (5, 7), (9, 10)]


def test_every_simd_loop_of_the_kernels_vectorises():
    from k3x.runtime.ort_kernels import compiler_command, sources

    skip_without_ort_headers()
    command = compiler_command()
    scalar, total = [], 0
    families = sources()
    # the shared headers (ort_kernel.h, a family's own such as kda/ort_recurrence.h): their loops vectorised
    # where a kernel that includes them calls them
    root = next(iter(families.values())).parent.parent
    headers = sorted(root.rglob("*.h"))
    in_header: list[set[int]] = [set() for _ in headers]
    for family, source in families.items():
        done, shared = vectorised_lines(source, command, headers)
        in_header = [a | b for a, b in zip(in_header, shared)]
        for first, last in simd_loops(source):
            total += 1
            if not done & set(range(first, last + 1)):
                scalar.append(f"{family}: {source.name} lines {first}-{last}")
    for header, done in zip(headers, in_header):
        for first, last in simd_loops(header):
            total += 1
            if not done & set(range(first, last + 1)):
                scalar.append(f"{header.relative_to(root)} lines {first}-{last}")
    assert total >= 10  # the kernels' loops were found
    assert any(simd_loops(h) for h in headers if h.name != "ort_kernel.h")  # a family's header was read too
    assert not scalar, "scalar `omp simd` loops: " + "; ".join(scalar)
