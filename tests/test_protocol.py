"""The protocol is declared once, in ``totalreduce/protocol.py``.

Every number two sides must agree on (a tag, a header field's offset, a magic, a frame
type, an error code, a word of the compiled lane's tables) is written there and imported
everywhere else.  These tests fail if one is written in another module, if the declared
offsets disagree with the declared ``struct`` formats, or if the docs' tables of frame
types and refusal reasons drift from the module.
"""

from __future__ import annotations

import ast
import re
import struct
from pathlib import Path

from totalreduce import protocol as P

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "totalreduce"
PROTOCOL = PACKAGE / "protocol.py"


def _declared() -> dict[str, object]:
    """Module-level names protocol.py assigns a literal to (its own constants)."""
    tree = ast.parse(PROTOCOL.read_text())
    out: dict[str, object] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            names = [t] if isinstance(t, ast.Name) else list(getattr(t, "elts", []))
            for n in names:
                if isinstance(n, ast.Name) and n.id.isupper():
                    out[n.id] = getattr(P, n.id)
    return out


def _literal(node: ast.AST) -> bool:
    """Is ``node`` a number or string written out (arithmetic of literals included)?"""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, str)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_literal(e) for e in node.elts)
    return False


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PROTOCOL)


def test_the_offsets_agree_with_the_formats() -> None:
    assert struct.calcsize(P.MSG_FORMAT) == P.MSG_SIZE
    assert struct.calcsize(P.FRAME_FORMAT) == P.FRAME_SIZE
    fmt = P.FRAME_FORMAT
    # the byte offset of field i: the size of the format's first i fields
    offsets = [struct.calcsize(fmt[: 1 + i]) for i in range(len(fmt) - 1)]
    for name, index in (("FH_TYPE", P.F_TYPE), ("FH_DTYPE", P.F_DTYPE), ("FH_KIND", P.F_KIND),
                        ("FH_ALGO", P.F_ALGO), ("FH_ROP", P.F_OP), ("FH_FLAGS", P.F_FLAGS),
                        ("FH_AUX", P.F_AUX), ("FH_STEP", P.F_STEP), ("FH_SEGMENT", P.F_SEGMENT),
                        ("FH_PRIO", P.F_PRIO), ("FH_WID", P.F_WID), ("FH_GEN", P.F_GEN),
                        ("FH_NBYTES", P.F_NBYTES), ("FH_COUNT", P.F_COUNT),
                        ("FH_PARAM", P.F_PARAM), ("FH_CONTEXT", P.F_CONTEXT)):  # fmt: skip
        assert getattr(P, name) == offsets[index], name
    mfmt = P.MSG_FORMAT
    moff = [struct.calcsize(mfmt[: 1 + i]) for i in range(len(mfmt) - 1)]
    assert (P.MH_MAGIC, P.MH_VERSION, P.MH_NFRAMES, P.MH_SENDER, P.MH_RESERVED,
            P.MH_CREDIT) == (moff[0], moff[1], moff[3], moff[4], moff[5], moff[6])  # fmt: skip


def test_one_numbering_of_frame_types_and_error_codes() -> None:
    values = [int(t) for t in P.FrameType]
    assert len(set(values)) == len(values)
    assert P.LANE_FRAME_TYPES <= {int(t) for t in P.FrameType}
    assert P.LANE_FRAME_TYPES == {int(t) for t in P.FrameType}  # one engine takes them all
    assert P.CONTROL_FRAME_TYPES <= P.LANE_FRAME_TYPES
    codes = [int(c) for c in P.ErrorCode]
    assert len(set(codes)) == len(codes) and set(P.ERROR_CLASSES) == set(P.ErrorCode)
    import totalreduce.errors as errors

    for cls in P.ERROR_CLASSES.values():
        assert issubclass(getattr(errors, cls), errors.TotalReduceError)
    mf = {v for k, v in vars(P).items() if k.startswith("MF_")}
    assert mf == set(P.MALFORMED_TEXTS)


def test_no_protocol_constant_is_written_in_another_module() -> None:
    declared = _declared()
    wrong = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign) or not _literal(node.value):
                continue
            for t in node.targets:
                names = [t] if isinstance(t, ast.Name) else list(getattr(t, "elts", []))
                for n in names:
                    # the arena's words keep their short names in transport/arena.py: no
                    # module may write one of those out either (an enum's member may share one)
                    arena = id(node) in top and f"AR_{getattr(n, 'id', '')}" in declared
                    if isinstance(n, ast.Name) and (n.id in declared or arena):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {n.id}")
    assert not wrong, "protocol constants written outside totalreduce/protocol.py: " + str(wrong)


def test_no_format_magic_or_frame_offset_is_written_out_elsewhere() -> None:
    formats = {P.MSG_FORMAT, P.FRAME_FORMAT, P.MSG_FORMAT[1:], P.FRAME_FORMAT[1:]}
    magics = {P.LANE_MAGIC}
    offset = re.compile(r"\b(?:ld|st)_[a-z0-9]+\((?:f|a|land|dst)(?: \+ \d+)?[,)]")
    wrong = []
    for path in _sources() + sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in formats:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} format {node.value!r}")
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                if not isinstance(node.value, bool) and node.value in magics:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} magic {node.value:#x}")
        for k, line in enumerate(text.splitlines(), 1):
            if offset.search(line):
                wrong.append(f"{path.relative_to(ROOT)}:{k} a frame field by its number")
    assert not wrong, wrong


def test_the_docs_tables_name_every_frame_type_and_refusal() -> None:
    arch = (ROOT / "docs" / "architecture.md").read_text()
    table = arch[arch.index("Frame types (") : arch.index("The lane's receiving pass")]
    rows = re.findall(r"^\| `([A-Z]+)` \| (\d+) \|", table, flags=re.M)
    assert {name: int(v) for name, v in rows} == {t.name: int(t) for t in P.FrameType}
    bounds = arch[arch.index("**Bounds, kept in compiled code.**") :]
    for text in P.MALFORMED_TEXTS.values():
        assert text.split(" (")[0] in arch or text in bounds, text
