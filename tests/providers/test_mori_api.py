"""The MoRI stand-in (tests/fake_mori) and the MoRI provider held to the real ``amd-mori`` 1.2.4 wheel.

The wheel's compiled libraries do not load on a CPU, so its Python files (and the C++ header with v1's
kernel-type enum) are read with ``ast`` straight from the zip. A test fails where a config field or its
default, an enum member, or the signature of a method the provider calls differs between the real
package and the stand-in, and where the provider names something the real package lacks.
``tests/run.sh`` downloads the wheel (``pip download``) into ``MORI_WHEEL_DIR``; without it these tests
are skipped.
"""

from __future__ import annotations

import ast
import os
import re
import zipfile
from functools import cache
from pathlib import Path

import pytest

WHEEL_NAME = "amd_mori-1.2.4-cp310-cp310-manylinux_2_35_x86_64.whl"
WHEEL_DIR_ENV = "MORI_WHEEL_DIR"
FAKE = Path(__file__).parents[1] / "fake_mori"
PROVIDERS = Path(__file__).parents[2] / "mori_sglang" / "providers"

V1 = "mori/ops/dispatch_combine.py"
V2 = "mori/ops/dispatch_combine_v2/dispatch_combine_op.py"
V2_HIP = "mori/ops/dispatch_combine_v2/hip_backend.py"
CCO = "mori/cco/communicator.py"
SHMEM = "mori/shmem/api.py"
KERNEL_HEADER = "mori/_jit-sources/include/mori/ops/dispatch_combine/dispatch_combine.hpp"
# Where each of those lives in the stand-in.
FAKE_FILE = {
    V1: "mori/ops/dispatch_combine.py",
    V2: "mori/ops/dispatch_combine_v2/dispatch_combine_op.py",
    V2_HIP: "mori/ops/dispatch_combine_v2/dispatch_combine_op.py",
    CCO: "mori/cco/__init__.py",
    SHMEM: "mori/shmem.py",
}


def _wheel() -> Path:
    folder = os.environ.get(WHEEL_DIR_ENV)
    path = Path(folder) / WHEEL_NAME if folder else None
    if path is None or not path.is_file():
        pytest.skip(
            f"the amd-mori 1.2.4 wheel ({WHEEL_NAME}) is not in {WHEEL_DIR_ENV}={folder!r}; tests/run.sh "
            "fetches it with `pip download --no-deps --only-binary=:all: --python-version 3.10 "
            "--platform manylinux_2_35_x86_64 amd-mori==1.2.4`"
        )
    return path


@cache
def _real_text(path: str) -> str:
    with zipfile.ZipFile(_wheel()) as wheel:
        return wheel.read(path).decode()


@cache
def _real(path: str) -> ast.Module:
    return ast.parse(_real_text(path))


@cache
def _fake(path: str) -> ast.Module:
    return ast.parse((FAKE / FAKE_FILE[path]).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    assert found, f"no class {name}"
    return found[0]


def _fields(cls: ast.ClassDef) -> list[tuple[str, str | None]]:
    """A dataclass's fields in order, each with its default as source text."""
    return [
        (node.target.id, None if node.value is None else ast.unparse(node.value))
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _signature(fn: ast.FunctionDef) -> tuple:
    """Parameter names in order with their defaults, keyword-only ones apart, as source text."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    keyword = [ast.unparse(d) if d is not None else None for d in args.kw_defaults]
    return (
        tuple(zip([a.arg for a in positional], defaults, strict=True)),
        tuple(zip([a.arg for a in args.kwonlyargs], keyword, strict=True)),
        args.vararg is not None,
        args.kwarg is not None,
    )


CONFIGS = [(V1, "EpDispatchCombineConfig"), (V2, "EpDispatchCombineConfig")]


@pytest.mark.parametrize(("path", "name"), CONFIGS)
def test_config_fields_and_defaults_are_the_real_ones(path: str, name: str) -> None:
    assert _fields(_class(_fake(path), name)) == _fields(_class(_real(path), name))


def test_v1_kernel_types_are_the_real_enum() -> None:
    body = re.search(r"enum KernelType \{(.*?)\};", _real_text(KERNEL_HEADER), re.S)
    assert body, "KernelType enum not found in the kernel header"
    real = {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body.group(1))}
    fake = {
        node.targets[0].id: node.value.value
        for node in _class(_fake(V1), "EpDispatchCombineKernelType").body
        if isinstance(node, ast.Assign)
    }
    assert fake == real


def _dict_keys(tree: ast.Module, name: str) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return [ast.literal_eval(k) for k in node.value.keys]
    raise AssertionError(f"no dict {name}")


def test_v1_quant_type_names_are_the_real_ones() -> None:
    assert _dict_keys(_fake(V1), "_QUANT_TYPE_MAP") == _dict_keys(_real(V1), "_QUANT_TYPE_MAP")


def _tuple_value(tree: ast.Module, name: str) -> tuple:
    """A module-level tuple built from literals, other such tuples, ``+`` and ``*``."""
    values: dict[str, tuple] = {}

    def evaluate(node: ast.AST) -> tuple:
        if isinstance(node, ast.Tuple):
            out: list = []
            for element in node.elts:
                out.extend(evaluate(element.value) if isinstance(element, ast.Starred) else [evaluate(element)])
            return tuple(out)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return evaluate(node.left) + evaluate(node.right)
        if isinstance(node, ast.Name):
            return values[node.id]
        return ast.literal_eval(node)

    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = evaluate(node.value)
            except (KeyError, ValueError, TypeError, AttributeError):
                continue
    return values[name]


@pytest.mark.parametrize("name", ["_FP4_QUANT_TYPES", "_PUSH_QUANT_TYPES", "_QUANT_TYPES"])
def test_v2_quant_types_are_the_real_ones(name: str) -> None:
    assert _tuple_value(_fake(V2), name) == _tuple_value(_real(V2), name)


# (file, class, methods) the provider calls; the stand-in must take the same parameters.
METHODS = [
    (V1, "EpDispatchCombineOp", ("__init__", "dispatch", "dispatch_send", "dispatch_recv")),
    (V1, "EpDispatchCombineOp", ("combine", "combine_send", "combine_recv")),
    (V2, "EpDispatchCombineOp", ("__new__", "dispatch", "combine", "close", "scale_stride_bytes")),
    (V2_HIP, "EpDispatchCombineOpHip", ("__init__", "scale_stride_bytes", "recv_scales")),
    (CCO, "Communicator", ("get_unique_id", "init", "barrier", "destroy")),
]


@pytest.mark.parametrize(("path", "cls", "names"), METHODS)
def test_method_signatures_are_the_real_ones(path: str, cls: str, names: tuple[str, ...]) -> None:
    real, fake = _methods(_class(_real(path), cls)), _methods(_class(_fake(path), cls))
    for name in names:
        assert name in real, f"the real {cls} has no {name}"
        assert name in fake, f"the stand-in's {cls} has no {name}"
        assert _signature(fake[name]) == _signature(real[name]), f"{cls}.{name}"


def test_shmem_functions_are_the_real_ones() -> None:
    real = {n.name: n for n in _real(SHMEM).body if isinstance(n, ast.FunctionDef)}
    fake = {n.name: n for n in _fake(SHMEM).body if isinstance(n, ast.FunctionDef)}
    for name in ("shmem_torch_process_group_init", "shmem_get_unique_id", "shmem_init_attr", "shmem_finalize"):
        assert _signature(fake[name]) == _signature(real[name]), name


# ---------------------------------------------------------------------------------------------
# what the provider names must exist in the real package
# ---------------------------------------------------------------------------------------------


def _provider_tree(name: str) -> ast.Module:
    return ast.parse((PROVIDERS / name).read_text())


def _attribute_chains(tree: ast.AST, root: str) -> set[tuple[str, ...]]:
    """Every ``root.a.b...`` the code reads."""
    chains = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            inner: ast.AST = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == root:
                chains.add(tuple(reversed(parts)))
    return chains


def _module_names(path: str) -> set[str]:
    """Names a real module defines or imports at its top level."""
    names = set()
    for node in _real(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_the_v1_provider_names_only_what_the_real_package_has() -> None:
    tree = _provider_tree("mori_v1.py")
    ops = _module_names("mori/ops/__init__.py") | {"dispatch_combine_v2"}  # lazy submodule
    for chain in _attribute_chains(tree, "mori") | _attribute_chains(_provider_tree("mori_provider.py"), "mori"):
        if len(chain) == 1:
            assert chain[0] in ("ops", "shmem"), chain
        elif chain[0] == "ops":
            assert chain[1] in ops, chain
        elif chain[0] == "shmem":
            assert chain[1] in _module_names(SHMEM), chain
        else:
            raise AssertionError(f"the provider reads mori.{'.'.join(chain)}")
    op_methods = _methods(_class(_real(V1), "EpDispatchCombineOp"))
    for chain in _attribute_chains(tree, "self"):
        if chain[0] == "op" and len(chain) > 1:
            assert chain[1] in op_methods, f"the real v1 op has no {chain[1]}"
    real_fields = {name for name, _ in _fields(_class(_real(V1), "EpDispatchCombineConfig"))}
    passed = _returned_dict_keys(tree, "mori_config_kwargs")
    assert passed and passed <= real_fields, passed - real_fields


def _returned_dict_keys(tree: ast.Module, function: str) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Return) and isinstance(inner.value, ast.Dict):
                    return {ast.literal_eval(k) for k in inner.value.keys}
    raise AssertionError(f"{function} returns no dict literal")


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _callee(call: ast.Call) -> str:
    return ast.unparse(call.func)


def _keywords_fit(call: ast.Call, fn: ast.FunctionDef) -> list[str]:
    positional, keyword, _, takes_kwargs = _signature(fn)
    accepted = {name for name, _ in positional} | {name for name, _ in keyword}
    return [] if takes_kwargs else [k.arg for k in call.keywords if k.arg not in accepted]


def test_the_v2_provider_names_only_what_the_real_package_has() -> None:
    tree = _provider_tree("mori_v2.py")
    imports = {
        (node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        for alias in node.names if (node.module or "").startswith("mori.")
    }  # fmt: skip
    assert imports == {("mori.cco", "Communicator"), ("mori.ops", "dispatch_combine_v2")}
    assert "Communicator" in _module_names("mori/cco/__init__.py")
    assert "dispatch_combine_v2" in _real_text("mori/ops/__init__.py")
    package = _module_names("mori/ops/dispatch_combine_v2/__init__.py")
    for chain in _attribute_chains(tree, "v2"):
        assert chain[0] in package, chain
    base = _methods(_class(_real(V2), "EpDispatchCombineOp"))
    hip = _methods(_class(_real(V2_HIP), "EpDispatchCombineOpHip"))
    communicator = _methods(_class(_real(CCO), "Communicator"))
    config_fields = {name for name, _ in _fields(_class(_real(V2), "EpDispatchCombineConfig"))}
    for call in _calls(tree):
        callee = _callee(call)
        if callee == "v2.EpDispatchCombineConfig":
            assert {k.arg for k in call.keywords} <= config_fields, callee
        elif callee.startswith("self.op."):
            name = callee.removeprefix("self.op.")
            fn = hip.get(name) or base.get(name)
            assert fn is not None, f"the real v2 op has no {name}"
            assert not _keywords_fit(call, fn), (callee, _keywords_fit(call, fn))
        elif callee.startswith(("self.comm.", "Communicator.")):
            name = callee.split(".")[-1]
            assert name in communicator, f"the real Communicator has no {name}"
            assert not _keywords_fit(call, communicator[name]), callee
    routing = _class(_real(V2), "EpDispatchRoutingHandle")
    assigned = {
        ast.unparse(target) for node in ast.walk(routing) if isinstance(node, ast.Assign) for target in node.targets
    }
    assert {"self.cur_rank_num_token", "self.disp_dest_tok_id_map"} <= assigned


SHMEM_WAITS = "mori/_jit-sources/include/mori/shmem/shmem_device_api.hpp"


def _env_names(text: str) -> set[str]:
    """The environment variables a Python or C++ source reads."""
    return set(re.findall(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](\w+)["']""", text))


def test_mori_bounds_no_wait_for_a_peer() -> None:
    """docs/api.md ("A peer that never sends"): MoRI 1.2.4 offers no timeout for its dispatch/combine
    waits, so SGLANG_MORI_PEER_TIMEOUT_S reaches them only at synchronize(). No config field, no variable
    the ops read, and the shmem wait helpers the v1 kernels spin in have no deadline. A release that
    adds a knob fails here: map the variable onto it."""
    for path, name in CONFIGS:
        fields = [field for field, _ in _fields(_class(_real(path), name))]
        assert not [field for field in fields if re.search("timeout|deadline", field, re.I)], (path, fields)
    with zipfile.ZipFile(_wheel()) as wheel:
        sources = [
            n for n in wheel.namelist()
            if n.startswith(("mori/ops/", "mori/_jit-sources/src/ops/")) and n.endswith((".py", ".cpp", ".hpp"))
        ]  # fmt: skip
        read = set().union(*(_env_names(wheel.read(n).decode()) for n in sources))
    assert {"MORI_EP_COMM", "MORI_DEVICE_NIC"} <= read  # the scan finds the variables the ops do read
    assert not [name for name in read if "TIMEOUT" in name], read
    waits = _real_text(SHMEM_WAITS)
    for helper in ("ShmemTypeWaitUntilEquals", "ShmemTypeWaitUntilGreaterThan"):
        body = re.search(rf"{helper}\(T\* addr, T val\) \{{(.*?)\n\}}", waits, re.S)
        assert body, f"{helper} not found in {SHMEM_WAITS}"
        assert "while" in body.group(1) and not re.search("clock|timeout", body.group(1), re.I), body.group(1)
