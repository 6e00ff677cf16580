"""The vocabulary of op declarations, and real functions built from them.

An op is declared once, in :mod:`totalreduce.ops_table`, as an :class:`OpDecl`:
its name, its parameters (each a :class:`Param` with a :class:`Kind` and a
default), what it takes (:class:`Takes`) and returns (:class:`Returns`), its
torch forms (:class:`TorchDecl`, :class:`Form`) and its other names
(:class:`Alias`).  The numpy API (``api.py``), the service's blocking methods
and the torch layer (``torch/collectives.py``, ``torch/horovod.py``) build
their functions from those records with :func:`build_function`.

:func:`build_function` writes a real ``def`` (as :mod:`dataclasses` does for
``__init__``): its parameters, defaults and keyword-only markers are the
declared ones, so ``help()``, :func:`inspect.signature` and a ``TypeError`` for
a wrong argument read as for a hand-written function, and a call costs no
argument binding at run time (``Signature.bind`` would cost microseconds on
every submission).

Pure: no torch, no numpy, no MPI.
"""

from __future__ import annotations

import enum
import inspect
import keyword
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class _Required:
    """The default of a parameter that has none."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a parameter the caller must pass.
REQUIRED: Any = _Required()

#: The name of the ``**kw`` parameter that carries the rest of an op's parameters.
MORE = "**kw"


class Kind(enum.Enum):
    """What a parameter is; the torch layer acts on its own kinds (``SERVICE`` and below)."""

    INPUT = "the input buffer"
    OUTPUT = "the output buffer"
    NAME = "the op's name"
    OP = "the reduce op"
    ROOT = "the root rank"
    PEER = "the peer rank"
    TAG = "the message tag"
    PRIORITY = "the priority"
    ALGORITHM = "the algorithm"
    GROUP = "the group of ranks"
    DTYPE = "the element type's name"
    PARTITION = "the partition"
    AXES = "the partition axes"
    TOPOLOGY = "the topology"
    STEP = "the topology's step"
    WEIGHTS = "the weights of what a rank receives (its own and its sources')"
    SEND_WEIGHTS = "the weights of what a rank sends"
    RANKS = "neighbor ranks"
    SPLITS = "the parts' sizes"
    COUNT = "a count"
    # The torch layer's own: resolved there, never passed to the service.
    SERVICE = "the service (default: init()'s)"
    STAGING = "the pool staging copies come from"
    AVERAGE = "Horovod's and BlueFog's average= (True: op avg, False: op sum)"
    ROOT_RANK = "Horovod's name for root"
    OLDER_NAME = "an older name of another parameter"
    UNUSED = "accepted for compatibility, changes nothing"
    FLAT = "join the parts flattened"
    COMPRESSION = "Horovod's compression: the dtype the tensor travels in"
    PRESCALE = "a factor the input is multiplied by before the reduction (Horovod's)"
    POSTSCALE = "a factor the result is multiplied by after the reduction (Horovod's)"


#: The annotation a parameter of each kind shows (``| None`` is added for a None default).
ANNOTATIONS: dict[Kind, str] = {
    Kind.INPUT: "Any",
    Kind.OUTPUT: "Any",
    Kind.NAME: "str | int | None",
    Kind.OP: "str",
    Kind.ROOT: "int",
    Kind.PEER: "int",
    Kind.TAG: "int",
    Kind.PRIORITY: "int",
    Kind.ALGORITHM: "str",
    Kind.GROUP: "Group",
    Kind.DTYPE: "str",
    Kind.PARTITION: "Partition",
    Kind.AXES: "Any",
    Kind.TOPOLOGY: "Any",
    Kind.STEP: "int",
    Kind.WEIGHTS: "Any",
    Kind.SEND_WEIGHTS: "Any",
    Kind.RANKS: "Any",
    Kind.SPLITS: "Sequence[int]",
    Kind.COUNT: "int",
    Kind.SERVICE: "ServiceLike",
    Kind.STAGING: "PinnedPool",
    Kind.AVERAGE: "bool",
    Kind.ROOT_RANK: "int",
    Kind.OLDER_NAME: "Any",
    Kind.UNUSED: "bool",
    Kind.FLAT: "bool",
    Kind.COMPRESSION: "Any",
    Kind.PRESCALE: "float",
    Kind.POSTSCALE: "float",
}


class Form(enum.Enum):
    """The torch forms of an op: ``_async`` or blocking, new tensor or in place (``_``)."""

    ASYNC = "{}_async"
    ASYNC_IN_PLACE = "{}_async_"
    BLOCKING = "{}"
    BLOCKING_IN_PLACE = "{}_"

    def name_of(self, op: str) -> str:
        """This form's function name for op ``op``: ``allreduce`` -> ``allreduce_async_``."""
        return self.value.format(op)

    @property
    def blocking(self) -> bool:
        return self in (Form.BLOCKING, Form.BLOCKING_IN_PLACE)

    @property
    def in_place(self) -> bool:
        return self in (Form.ASYNC_IN_PLACE, Form.BLOCKING_IN_PLACE)


#: Every torch form, and the ``_async`` ones.
ALL_FORMS = frozenset(Form)
ASYNC_FORMS = frozenset({Form.ASYNC, Form.ASYNC_IN_PLACE})
NEW_TENSOR_FORMS = frozenset({Form.ASYNC, Form.BLOCKING})


class Takes(enum.Enum):
    """What an op's first parameter is."""

    ONE = "one array (one tensor)"
    LIST = "a list of tensors"
    NONE = "no buffer"


class Returns(enum.Enum):
    """What ``wait()`` (and the blocking form) returns; the value is the annotation."""

    ARRAY = "np.ndarray"
    ON_ROOT = "Any"  # the result on the root, None elsewhere
    NOTHING = "None"


@dataclass(frozen=True)
class Param:
    """One parameter: its name, its kind and its default.

    ``keyword_only`` puts it after the ``*``; ``forms`` limits it to some torch
    forms (None: every form that has the op); ``of`` names the parameter an
    ``OLDER_NAME`` stands for; ``annotation`` overrides the kind's.
    """

    name: str
    kind: Kind
    default: Any = REQUIRED
    keyword_only: bool = False
    forms: frozenset[Form] | None = None
    of: str = ""
    annotation: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or keyword.iskeyword(self.name):
            raise ValueError(f"parameter name {self.name!r} is not an identifier")
        if (self.kind is Kind.OLDER_NAME) != bool(self.of):
            raise ValueError(f"parameter {self.name!r}: of= goes with kind OLDER_NAME only")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def shown_annotation(self) -> str:
        """The annotation its functions show."""
        text = self.annotation or ANNOTATIONS[self.kind]
        if self.default is None and text != "Any" and "None" not in text.split(" | "):
            text += " | None"
        return text

    def but(self, **changes: Any) -> Param:
        """A copy with ``changes`` (``NAME.but(default=...)``)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return Param(**values)


@dataclass(frozen=True)
class TorchDecl:
    """The torch forms of an op: their parameters, which forms exist, and their docs.

    Every form takes ``params`` less those whose ``forms`` leave it out.  A
    parameter the service method has (by name) is passed on to it; the others
    are the torch layer's own kinds.  ``rows``: the result is joined along
    dimension 0 (Horovod's and torch's all-gather) unless ``flat=True``.
    ``bluefog_order``: BlueFog's positional order, taken when a float comes
    where the name goes (a name is a str or an int; BlueFog's ``self_weight`` a
    float).  ``doc`` is the ``_async`` form's docstring, ``doc_in_place`` the
    in-place one's; the blocking forms' say which ``_async`` form they wait for.
    """

    params: tuple[Param, ...]
    forms: frozenset[Form]
    doc: str
    doc_in_place: str = ""
    rows: bool = False
    bluefog_order: tuple[str, ...] = ()

    def params_of(self, form: Form) -> tuple[Param, ...]:
        """The parameters ``form`` takes, in order."""
        return tuple(p for p in self.params if p.forms is None or form in p.forms)


@dataclass(frozen=True)
class Alias:
    """An op's name in another library, with that library's parameters.

    ``dialect``: whose name it is (``Horovod``, ``BlueFog``); ``module``: where
    it lives; ``params``: its signature; ``forms``: its forms (``ASYNC`` and
    ``BLOCKING`` name ``{name}_async`` and ``{name}``).  ``derived`` aliases are
    built from the op's torch forms (``takes=LIST``: one op per tensor, named
    ``name.k``, one handle for the list); the others keep a body of their own in
    ``module`` because their meaning differs (Horovod's rows, say), and
    ``tests/test_declarations.py`` checks that body's signature against
    ``params``.
    """

    name: str
    dialect: str
    module: str
    params: tuple[Param, ...]
    doc: str
    takes: Takes = Takes.ONE
    forms: frozenset[Form] = frozenset({Form.BLOCKING})
    derived: bool = False
    note: str = ""


@dataclass(frozen=True)
class OpDecl:
    """One op: everything its functions in every layer are built from.

    ``params`` are the service method's (``{name}_async``), in order; ``api``
    names those the numpy functions and the service's blocking method take
    explicitly (None: all of them), with :data:`MORE` (``"**kw"``) where the
    rest follow as keywords.  ``doc`` is the blocking numpy function's
    docstring, ``async_doc`` the ``_async`` one's.  ``torch``: its torch forms
    (None: none).  ``aliases``: its Horovod and BlueFog names.  ``c10d``: the
    ``torch.distributed`` calls the ``"totalreduce"`` backend runs on this op.
    ``direct``: the service has ``_{name}_direct``, with the blocking method's
    parameters, which the blocking forms call instead of ``{name}_async(...).wait()``
    (a path of its own where it can, that wait otherwise).
    """

    name: str
    params: tuple[Param, ...]
    takes: Takes
    returns: Returns
    doc: str
    async_doc: str
    api: tuple[str, ...] | None = None
    torch: TorchDecl | None = None
    aliases: tuple[Alias, ...] = field(default=())
    c10d: tuple[str, ...] = ()
    direct: bool = False

    @property
    def method(self) -> str:
        """The service method that runs the op (every layer calls this one)."""
        return f"{self.name}_async"

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def api_params(self) -> tuple[Param, ...]:
        """The parameters the numpy functions name (before ``**kw``, if any)."""
        if self.api is None:
            return self.params
        by_name = {p.name: p for p in self.params}
        return tuple(by_name[n] for n in self.api if n != MORE)

    @property
    def api_more(self) -> bool:
        """Whether the numpy functions take the rest of the parameters as ``**kw``."""
        return self.api is not None and MORE in self.api

    def check(self) -> None:
        """Raise ValueError where the record contradicts itself."""
        names = self.param_names
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a parameter appears twice in {names}")
        if self.api is not None:
            explicit = [n for n in self.api if n != MORE]
            unknown = [n for n in explicit if n not in names]
            if unknown:
                raise ValueError(f"{self.name}: api names {unknown}, not parameters of the op")
            if self.api.count(MORE) > 1 or (MORE in self.api and self.api[-1] != MORE):
                raise ValueError(f"{self.name}: {MORE} goes last in api, once")
        if self.torch is not None:
            for p in self.torch.params:
                if p.kind is Kind.OLDER_NAME and p.of not in names:
                    raise ValueError(f"{self.name}: {p.name} stands for {p.of}, not a parameter")
            order = self.torch.bluefog_order
            torch_names = [p.name for p in self.torch.params]
            if order and not set(order) <= set(torch_names):
                raise ValueError(f"{self.name}: BlueFog's order {order} names unknown parameters")


@dataclass(frozen=True)
class WinDecl:
    """A window op (BlueFog's one-sided ops): its name, parameters and what it calls.

    ``params`` are the numpy function's, in order; a parameter whose ``forms`` is
    the empty set is the numpy function's only (the torch one leaves it out), and
    an ``INPUT`` parameter is the array, which the torch function takes as a
    tensor named ``tensor``.  ``call`` is the call of the service's
    :class:`~totalreduce.service.windows.Windows` that runs it, over the
    parameters' names.  ``nonblocking``: the op also has ``{name}_nonblocking``,
    which returns the transfer's handle, and the plain form waits for it.
    ``returns``: the plain numpy form's annotation; ``torch_body``: the torch
    function's statement where it differs from "the numpy function on the
    tensor's memory" (``_view`` is that memory), with helpers of
    ``totalreduce.torch.windows``.
    """

    name: str
    params: tuple[Param, ...]
    call: str
    returns: str
    doc: str
    nonblocking: bool = False
    torch_body: str = ""
    torch_returns: str = ""

    def numpy_params(self) -> tuple[Param, ...]:
        return self.params

    def torch_params(self) -> tuple[Param, ...]:
        """The torch function's: the tensor for the array, numpy-only ones left out."""
        out = []
        for p in self.params:
            if p.forms is not None and not p.forms:
                continue
            if p.kind is Kind.INPUT:
                p = p.but(name="tensor", annotation="torch.Tensor")
            out.append(p)
        return tuple(out)


# ---------------------------------------------------------------- signatures and functions


def signature(
    params: Iterable[Param], *, more: bool = False, first: str = "", returns: str = ""
) -> inspect.Signature:
    """The :class:`inspect.Signature` of ``params`` (``first``: a leading ``self``;
    ``more``: a trailing ``**kw``; ``returns``: the return annotation)."""
    P = inspect.Parameter
    out = [P(first, P.POSITIONAL_OR_KEYWORD)] if first else []
    for p in params:
        kind = P.KEYWORD_ONLY if p.keyword_only else P.POSITIONAL_OR_KEYWORD
        default = P.empty if p.required else p.default
        out.append(P(p.name, kind, default=default, annotation=p.shown_annotation()))
    if more:
        out.append(P("kw", P.VAR_KEYWORD, annotation="Any"))
    return inspect.Signature(out, return_annotation=returns or inspect.Signature.empty)


def build_function(
    name: str,
    sig: inspect.Signature,
    body: str,
    env: Mapping[str, Any],
    *,
    doc: str,
    module: str,
    qualname: str = "",
    declared: tuple[str, str] = ("", ""),
) -> Callable[..., Any]:
    """A function ``name`` with signature ``sig`` whose body is ``body``.

    ``body`` is one statement (``return target(x=x, ...)``) over the
    parameters and the names in ``env``; :func:`forward` writes the argument
    list.  Defaults are bound by reference, never by ``repr``.  ``declared``
    (the op's name and the form, e.g. ``("allreduce", "async")``) is kept as
    the function's ``__op_declaration__``, which the tests read.
    """
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"function name {name!r} is not an identifier")
    defaults: dict[str, Any] = {}
    parts: list[str] = []
    star = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            defaults[f"_default_{p.name}"] = p.default
            parts.append(f"{p.name}=_default_{p.name}")
    source = f"def {name}({', '.join(parts)}):\n    {body}\n"
    namespace: dict[str, Any] = {**env, **defaults}
    exec(compile(source, f"<totalreduce: {module}.{name}>", "exec"), namespace)  # noqa: S102
    fn: Callable[..., Any] = namespace[name]
    fn.__doc__ = doc
    fn.__module__ = module
    fn.__qualname__ = qualname or name
    fn.__op_declaration__ = declared  # type: ignore[attr-defined]
    fn.__annotations__ = {
        p.name: p.annotation for p in sig.parameters.values() if p.annotation is not p.empty
    }
    if sig.return_annotation is not sig.empty:
        fn.__annotations__["return"] = sig.return_annotation
    return fn


def forward(sig: inspect.Signature, skip: tuple[str, ...] = (), in_order: bool = False) -> str:
    """``a=a, b=b, **kw``: every parameter of ``sig`` passed on by keyword.  ``in_order``
    (for a callee whose leading parameters are ``sig``'s, in its order): the positional
    ones by position, ``a, b, c=c, **kw``, which a call parses faster."""
    out = []
    for p in sig.parameters.values():
        if p.name in skip:
            continue
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        elif in_order and p.kind is p.POSITIONAL_OR_KEYWORD:
            out.append(p.name)
        else:
            out.append(f"{p.name}={p.name}")
    return ", ".join(out)
