"""Build the package's Triton kernels for a GPU architecture without a GPU and read what that GPU would run.

Each build specialises the kernel exactly as a real launch does (Triton's own argument specialisation: 16-byte
pointer alignment and integer divisibility by 16 as ``tt.divisibility`` attributes, unit strides as constants),
compiles it with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` and reads the cubin with
Triton's bundled ``cuobjdump --dump-resource-usage`` and ``cuobjdump -sass``. The TTGIR says which loads the software
pipeliner turned into asynchronous copies (``ttg.async_copy_global_to_local``, cp.async / ``LDGSTS`` in SASS) and
how many shared-memory buffers each has. A build passes when:

* it compiles, with no spills (no ``STL``/``LDL`` in the SASS, stack and local bytes 0);
* its matrix products (the MoE kernel's) use the tensor cores: ``HGMMA`` (warpgroup MMA) on sm_90, ``HMMA``
  (``mma.sync``) on sm_80/86/89 and on consumer Blackwell (sm_120, which has no warpgroup or tcgen05 MMA);
* every weight operand is prefetched by the pipeliner (an async copy into a multi-buffered shared-memory ring; no
  synchronous load of it left) with ``num_stages >= 3``: the MoE kernel's three weight tiles, the int4
  dequantization kernel's code tiles (its one scale row per step, 2 bytes a thread, is below cp.async's 4);
* its shared memory fits the architecture's per-block limit (sm_90 227 KB, sm_80 163 KB, sm_86/89/120 99 KB);
* its atomic adds (atomic MoE mode) are native reductions, not compare-and-swap loops.

``python -m tests.helpers.kernel_build`` prints the table of the builds the launch table chooses at the
released shape (MoE: 12 heads x 256 experts, top-6, Dh 256, De 1280, bf16 activations with bf16, FP8 or int4
experts, atomic and deterministic; int4 runs the MoE kernel once per head on that head's dequantized bf16 banks,
and the int4 dequantization kernel on each bank shape), ``--scan`` tries the candidates given with ``--configs``.
It must run without
``TRITON_INTERPRET=1`` (the interpreter replaces the kernels); the test suite calls it in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch


__all__ = [
    "ARCH_SHARED_LIMIT",
    "BuildResult",
    "KernelBuild",
    "build",
    "build_problems",
    "checked_builds",
    "format_table",
    "missing_tools",
    "package_kernels",
]

#: Largest dynamic shared memory per block (opt-in) of each checked architecture, in bytes (the CUDA programming
#: guide's table; sm_86, sm_89 and sm_120 have 100 KB per SM, of which 99 KB for one block): RTX 5090, H100/H200,
#: RTX 4090/L40S, RTX 3090/A6000, A100.
ARCH_SHARED_LIMIT = {120: 99 * 1024, 90: 227 * 1024, 89: 99 * 1024, 86: 99 * 1024, 80: 163 * 1024}
#: Expected tensor-core instruction per architecture: warpgroup MMA on Hopper, ``mma.sync`` (``HMMA``) elsewhere;
#: Triton has no tcgen05 path for consumer Blackwell (sm_120), which runs ``mma.sync`` as Ampere and Ada do.
ARCH_MMA = {120: "HMMA", 90: "HGMMA", 89: "HMMA", 86: "HMMA", 80: "HMMA"}
#: Architectures with FP8 (e4m3) conversions and MMA: compute capability 8.9 and newer.
FP8_ARCHS = tuple(arch for arch in ARCH_SHARED_LIMIT if arch >= 89)
MIN_STAGES = 3

#: The released MoE shape: heads, experts per head, top-k, Dh, De (tokens only set the strides of x).
RELEASED_MOE = {"heads": 12, "experts": 256, "top_k": 6, "head_dim": 256, "expert_dim": 1280, "tokens": 4096}
#: TTGIR value names of the MoE kernel's weight tiles (its Python variable names): W_gate, W_up, W_down.
MOE_WEIGHT_OPERANDS = ("wg", "wu", "wd")
#: The int4 dequantization kernel and the TTGIR name of its code tiles.
DEQUANT_KERNEL, DEQUANT_OPERANDS = "_dequantize_int4_kernel", ("codes",)
#: ``(K, N)`` of the dequantized banks at the released shape: W_gate/W_up [Dh, De], W_down [De, Dh].
RELEASED_INT4_BANKS = {"W_gate/W_up": (256, 1280), "W_down": (1280, 256)}


@dataclass(frozen=True)
class KernelBuild:
    """One build: a kernel of the package for one architecture, problem and launch config."""

    kernel: str  # e.g. "_mh_moe_fwd_kernel"
    arch: int  # 120, 90, 89, 86, 80
    weights: str  # "bfloat16", "float8_e4m3fn" or "int4"
    deterministic: bool
    config: tuple[int, ...]  # TileConfig fields; the dequantization kernel: (BLOCK_N, num_warps, num_stages)
    source: str  # where the config came from, e.g. "launch table sm_90"; the dequantization kernel: its bank

    @property
    def mode(self) -> str:
        if self.kernel == DEQUANT_KERNEL:
            return self.source.split(" ")[0]  # the bank, e.g. "W_down"
        return "deterministic" if self.deterministic else "atomic"


@dataclass
class BuildResult:
    """What one build gave (``error`` set when it did not compile)."""

    build: KernelBuild
    error: Optional[str] = None
    registers: int = 0
    stack_bytes: int = 0
    local_bytes: int = 0
    spill_stores: int = 0  # STL in the SASS
    spill_loads: int = 0  # LDL
    shared_bytes: int = 0  # dynamic shared memory the launch requests
    mma: str = "none"  # HGMMA, HMMA or none
    num_stages: int = 0
    prefetch: dict = field(default_factory=dict)  # weight operand -> shared-memory buffers of its async copy (0: none)
    ldgsts: int = 0  # cp.async instructions in the SASS
    atomics: str = "-"  # native (RED) / CAS loop / -
    seconds: float = 0.0


def missing_tools() -> Optional[str]:
    """``None`` when Triton's bundled ``ptxas`` and ``cuobjdump`` and the JIT internals the builds use are present,
    else a sentence saying what is not."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as err:
        return f"Triton's compiler internals cannot be imported ({err})"
    if not hasattr(JITFunction, "_pack_args"):
        return "this Triton's JIT has no _pack_args (the builds mirror Triton 3.9's launch specialisation)"
    names = ["ptxas", "cuobjdump"] + (["ptxas_blackwell"] if hasattr(knobs.nvidia, "ptxas_blackwell") else [])
    for name in names:
        try:
            path = getattr(knobs.nvidia, name).path
        except Exception as err:  # the knob raises when the binary cannot be found
            return f"Triton's bundled {name} is missing ({err})"
        if not path or not os.path.isfile(path):
            return f"Triton's bundled {name} is missing (looked for {path})"
    return None


def package_kernels() -> dict[str, list[str]]:
    """``{module: [kernel names]}``: every ``@triton.jit`` function of the package that no other one calls (the
    launchable kernels; helpers are inlined into them), found by reading the source."""
    import diffusers_magi2

    root = Path(diffusers_magi2.__file__).resolve().parent
    found: dict[str, list[str]] = {}
    texts = {path: path.read_text() for path in sorted(root.rglob("*.py"))}
    package = "\n".join(texts.values())  # a helper may be called from another module (e.g. the roundings)
    for path, text in texts.items():
        names = re.findall(r"^@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", text, re.M)
        if not names:
            continue
        kernels = [n for n in names if not re.search(rf"(?<![\w.]){n}\(", package.replace(f"def {n}(", ""))]
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        if kernels:
            found[module] = kernels
    return found


# --------------------------------------------------------------------------------------------------- building


def _meta_moe_inputs(weights: str) -> tuple:
    """Meta tensors of the released MoE shape (no memory, no values): x, routes, banks, scales."""
    s = RELEASED_MOE
    heads, experts, dh, de = s["heads"], s["experts"], s["head_dim"], s["expert_dim"]
    flat, num_routes = heads * experts, s["tokens"] * heads * s["top_k"]
    meta = torch.device("meta")
    wdtype = None if weights == "int4" else getattr(torch, weights)
    x = torch.empty(s["tokens"], heads, dh, dtype=torch.bfloat16, device=meta)
    gather_ids = torch.empty(num_routes, dtype=torch.int32, device=meta)
    probs = torch.empty(num_routes, dtype=torch.float32, device=meta)
    offsets = torch.empty(flat + 1, dtype=torch.int64, device=meta)
    shapes, scales = ((dh, de), (dh, de), (de, dh)), None
    if weights == "int4":
        banks, scales = zip(*(_meta_int4_bank((flat, *shape)) for shape in shapes))
        return x, (gather_ids, probs, offsets), banks, scales
    banks = tuple(torch.empty(flat, *shape, dtype=wdtype, device=meta) for shape in shapes)
    if wdtype == torch.float8_e4m3fn:
        scales = tuple(torch.empty(flat, n, dtype=torch.float32, device=meta) for n in (de, de, dh))
    return x, (gather_ids, probs, offsets), banks, scales


def _meta_int4_bank(shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta int4 codes and group scales of a bank ``[R, K, N]`` at the default group size."""
    from diffusers_magi2.moe.quantize_int4 import INT4_GROUP_SIZE, INT4_PACKED_DTYPE, INT4_SCALE_DTYPE, int4_shapes

    packed, scale = int4_shapes(shape, INT4_GROUP_SIZE)
    meta = torch.device("meta")
    return torch.empty(packed, dtype=INT4_PACKED_DTYPE, device=meta), torch.empty(
        scale, dtype=INT4_SCALE_DTYPE, device=meta
    )


def _moe_launch(build_spec: KernelBuild):
    """The MoE kernel's positional arguments and keyword arguments for ``build_spec``, as the launcher builds them
    (int4: head 0's launch; every head's has the same specialisation).

    Raises:
        ValueError: from the launcher (e.g. FP8 experts below sm_89).
    """
    from diffusers_magi2.moe import experts_triton as et

    x, routes, banks, scales = _meta_moe_inputs(build_spec.weights)
    capability = divmod(build_spec.arch, 10)
    spec = et.launch_specs(
        x, routes, banks, scales=scales, deterministic=build_spec.deterministic, capability=capability
    )[0]
    config = et.TileConfig(*build_spec.config)
    args = spec.make_args(et.tile_offsets_for(spec.offsets, config.block_t))
    return et._mh_moe_fwd_kernel, args, et.kernel_meta(config, spec.constants)


def _dequant_launch(build_spec: KernelBuild):
    """The int4 dequantization kernel's arguments for ``build_spec`` (its ``source`` names the bank), as the MoE
    launcher builds them: one head's 256 experts into a bf16 buffer."""
    from diffusers_magi2.moe import dequantize_triton as dq

    k, n = RELEASED_INT4_BANKS[build_spec.mode]
    packed, scale = _meta_int4_bank((RELEASED_MOE["experts"], k, n))
    out = torch.empty(packed.shape[0], k, n, dtype=torch.bfloat16, device="meta")
    args, kwargs, _ = dq.dequant_launch(packed, scale, out, interpret=False)
    return dq._dequantize_int4_kernel, args, kwargs


def _compile(kernel, args: tuple, kwargs: dict, arch: int):
    """``triton.compile`` of ``kernel`` for ``sm_<arch>`` with the specialisation a launch of ``args``/``kwargs``
    gets (the JIT's own binder and argument packing, then the same ``ASTSource`` it compiles)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as JITFunction.run sets them (3.9)
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def _read(result: BuildResult, compiled, weight_operands: tuple[str, ...]) -> None:
    """Fill ``result`` from the compiled kernel's cubin (cuobjdump) and TTGIR."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True)
        sass = sass.stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"cannot read cuobjdump --dump-resource-usage output:\n{usage}")
    result.registers, result.stack_bytes, static_shared, result.local_bytes = map(int, match.groups())
    result.shared_bytes = int(compiled.metadata.shared) + static_shared
    opcodes = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", sass, re.M)
    bases = [op.split(".")[0] for op in opcodes]
    result.spill_stores, result.spill_loads = bases.count("STL"), bases.count("LDL")
    result.mma = next((kind for kind in ("HGMMA", "HMMA") if kind in bases), "none")
    result.ldgsts = bases.count("LDGSTS")
    if any(op.startswith(("ATOMG", "ATOM.", "ATOMS")) and ".CAS" in op for op in opcodes):
        result.atomics = "CAS loop"
    elif any(b in ("RED", "REDG", "REDUX") or b.startswith("ATOMG") for b in bases):
        result.atomics = "native"
    ttgir = compiled.asm["ttgir"]
    for name in weight_operands:
        buffers = re.findall(rf"%{name}(?:_\d+)? = ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x", ttgir)
        copies = re.findall(
            rf"%{name}(?:_\d+)? = (?:ttg\.async_copy_global_to_local|ttng\.async_tma_copy_global_to_local)", ttgir
        )
        sync_loads = re.findall(rf"%{name}(?:_\d+)? = tt\.(?:load|descriptor_load) ", ttgir)
        result.prefetch[name] = int(buffers[0]) if buffers and copies and not sync_loads else 0


def build(build_spec: KernelBuild) -> BuildResult:
    """Compile ``build_spec`` for its architecture and read the result (``error`` set if it does not compile)."""
    import time

    start = time.perf_counter()
    result = BuildResult(build_spec, num_stages=build_spec.config[-1])
    try:
        recipes = {
            "_mh_moe_fwd_kernel": (_moe_launch, MOE_WEIGHT_OPERANDS),
            DEQUANT_KERNEL: (_dequant_launch, DEQUANT_OPERANDS),
        }
        if build_spec.kernel not in recipes:
            raise ValueError(f"no build recipe for kernel {build_spec.kernel!r}")
        launch, operands = recipes[build_spec.kernel]
        kernel, args, kwargs = launch(build_spec)
        compiled = _compile(kernel, args, kwargs, build_spec.arch)
        _read(result, compiled, operands)
    except Exception as err:  # reported per build, checked by the caller
        result.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    result.seconds = time.perf_counter() - start
    return result


def build_problems(result: BuildResult) -> list[str]:
    """What is wrong with one build (empty: it passes every check of the module docstring)."""
    b = result.build
    if result.error:
        return [f"does not compile: {result.error}"]
    problems = []
    if result.spill_stores or result.spill_loads or result.stack_bytes or result.local_bytes:
        problems.append(
            f"spills: {result.spill_stores} STL, {result.spill_loads} LDL, stack {result.stack_bytes} B, "
            f"local {result.local_bytes} B"
        )
    if b.kernel != DEQUANT_KERNEL and result.mma != ARCH_MMA[b.arch]:  # the dequantization kernel has no GEMM
        problems.append(f"uses {result.mma}, expected {ARCH_MMA[b.arch]} on sm_{b.arch}")
    not_prefetched = [name for name, buffers in result.prefetch.items() if buffers < 2]
    if not_prefetched or result.ldgsts == 0:
        problems.append(f"weight operands not prefetched: {not_prefetched or 'no LDGSTS in SASS'}")
    if result.num_stages < MIN_STAGES:
        problems.append(f"num_stages {result.num_stages} < {MIN_STAGES}")
    if result.shared_bytes > ARCH_SHARED_LIMIT[b.arch]:
        problems.append(f"shared memory {result.shared_bytes} B > {ARCH_SHARED_LIMIT[b.arch]} B on sm_{b.arch}")
    if result.atomics == "CAS loop":
        problems.append("atomic adds compile to compare-and-swap loops")
    return problems


def checked_builds() -> tuple[list[KernelBuild], list[tuple[int, str, str]]]:
    """The builds the launch table chooses at the released shape, and the combinations the launcher must refuse.

    Returns:
        ``(builds, refused)``: per architecture of :data:`ARCH_SHARED_LIMIT` (table entry ``sm_XY``) the first
        candidate for bf16, FP8 and int4 experts (int4: the bf16 candidate, per head), atomic and deterministic, and
        the int4 dequantization kernel for each bank shape; ``refused`` lists ``(arch, weights, reason)`` for FP8
        below sm_89 (sm_80, sm_86), where :func:`~diffusers_magi2.moe.experts_triton.launch_specs` raises
        ``ValueError``.
    """
    from diffusers_magi2.moe import experts_triton as et

    s = RELEASED_MOE
    builds, refused = [], []
    for arch in ARCH_SHARED_LIMIT:
        keys = (f"sm_{arch}",)
        entry = et.resolve_device_entry(keys)
        for weights in ("bfloat16", "float8_e4m3fn", "int4"):
            if weights == "float8_e4m3fn" and arch not in FP8_ARCHS:
                refused.append((arch, weights, "FP8 experts need compute capability >= 8.9"))
                continue
            table_weights = torch.bfloat16 if weights == "int4" else getattr(torch, weights)  # int4: bf16 banks
            candidates = et.tile_candidates(keys, s["head_dim"], s["expert_dim"], torch.bfloat16, table_weights)
            config = tuple(asdict(candidates[0]).values())
            for deterministic in (False, True):
                builds.append(
                    KernelBuild("_mh_moe_fwd_kernel", arch, weights, deterministic, config, f"table {entry}")
                )
    return builds + dequant_builds(tuple(ARCH_SHARED_LIMIT)), refused


def dequant_builds(archs: tuple[int, ...]) -> list[KernelBuild]:
    """The int4 dequantization kernel's builds: one per bank shape of the released size and architecture (bank
    by bank, so that a parallel run compiles each architecture's one specialisation once)."""
    from diffusers_magi2.moe import dequantize_triton as dq

    config = (dq.DEQUANT_BLOCK_N, dq.DEQUANT_NUM_WARPS, dq.DEQUANT_NUM_STAGES)
    return [
        KernelBuild(DEQUANT_KERNEL, arch, "int4", False, config, f"{bank} [256 x {k} x {n}] -> bf16")
        for bank, (k, n) in RELEASED_INT4_BANKS.items()
        for arch in archs
    ]


def refusal_error(arch: int, weights: str) -> Optional[str]:
    """The ``ValueError`` message the launcher raises for ``weights`` on ``sm_<arch>``, or ``None`` if it builds."""
    try:
        _moe_launch(KernelBuild("_mh_moe_fwd_kernel", arch, weights, False, (64, 16, 4, 3), "refusal"))
    except ValueError as err:
        return str(err)
    return None


def run_builds(builds: list[KernelBuild], jobs: int = 2) -> list[BuildResult]:
    """Build all, ``jobs`` at a time (forked workers: the package is imported once)."""
    if jobs <= 1 or len(builds) <= 1:
        return [build(b) for b in builds]
    with multiprocessing.get_context("fork").Pool(min(jobs, len(builds))) as pool:
        return pool.map(build, builds, chunksize=1)


def format_table(results: list[BuildResult]) -> str:
    """One row per build: target, weights, mode, config, registers, spills, shared bytes, MMA, stages, prefetch."""
    head = (
        f"{'kernel':<23} {'arch':<6} {'experts':<8} {'mode':<13} {'config':<17} {'regs':>4} {'spill':>9} "
        f"{'shared':>7} {'mma':<6} {'stages':>6} {'buffers':<16} {'atomics':<9} {'s':>5}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        b = r.build
        problems = build_problems(r)
        spill = f"{r.spill_stores + r.spill_loads}/{r.stack_bytes}B"
        buffers = "/".join(str(v) for v in r.prefetch.values()) or "-"
        weights = {"float8_e4m3fn": "fp8", "bfloat16": "bf16"}.get(b.weights, b.weights)
        lines.append(
            f"{b.kernel:<23} sm_{b.arch:<3} {weights:<8} {b.mode:<13} {str(list(b.config)):<17} {r.registers:>4} "
            f"{spill:>9} {r.shared_bytes:>7} {r.mma:<6} {r.num_stages:>6} {buffers:<16} {r.atomics:<9} "
            f"{r.seconds:>5.1f}  {'ok' if not problems else '; '.join(problems)}"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--jobs", type=int, default=2, help="builds in parallel (default 2)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a build has a problem or is not refused")
    parser.add_argument("--scan", action="store_true", help="build --configs for --arch/--weights instead")
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCH_SHARED_LIMIT))
    parser.add_argument("--weights", nargs="+", default=["bfloat16", "float8_e4m3fn", "int4"])
    parser.add_argument("--configs", nargs="*", default=[], help="block_t,block_de,num_warps,num_stages ...")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run without TRITON_INTERPRET=1 (the interpreter replaces the kernels that are built here)")
    missing = missing_tools()
    if missing:
        print(json.dumps({"skipped": missing}) if args.json else f"skipped: {missing}")
        return 0
    refused = []
    if args.scan:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
        builds = [
            KernelBuild("_mh_moe_fwd_kernel", arch, weights, det, config, "scan")
            for arch in args.arch
            for weights in args.weights
            if not (weights.startswith("float8") and arch not in FP8_ARCHS)
            for det in (False, True)
            for config in configs
        ]
    else:
        builds, refused = checked_builds()
    results = run_builds(builds, jobs=args.jobs)
    refusals = [{"arch": a, "weights": w, "expected": why, "error": refusal_error(a, w)} for a, w, why in refused]
    if args.json:
        rows = [{**asdict(r), "problems": build_problems(r)} for r in results]
        print(json.dumps({"builds": rows, "refusals": refusals, "kernels": package_kernels()}))
    else:
        print(format_table(results))
        for refusal in refusals:
            print(f"sm_{refusal['arch']} {refusal['weights']}: refused by the launcher: {refusal['error']}")
    failed = any(build_problems(r) for r in results) or any(r["error"] is None for r in refusals)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
