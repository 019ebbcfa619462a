"""The plan of a patch: every decoder feature's option resolved, with why, before anything is installed.

A decoder feature that takes a ``patch_model`` keyword owns its option: a ``FeatureOption`` object (the feature's
``options``) with its keywords and defaults, the check of a value, its ``"auto"`` rule and the facts that rule reads
(``PlanFacts``: the model's device and dtype, the spec, the parallel context; the installed packages it probes
itself; the decisions of the options it names in ``needs``), and the ``Conflict`` s it declares with other options.
``build_plan`` resolves the options in the order their ``needs`` and conflicts imply and returns a ``PatchPlan``:
one ``Decision`` per option (what was asked, by whom, what runs, on which layers or modules, and why). A conflict
that holds is refused when both options were asked for (a ``ValueError`` naming both and what to pass instead); an
option left to ``"auto"`` yields to it instead (its decision says why). Nothing is installed before the whole plan
stands.

A plan also says, per active feature, what a batch-invariant call does with it (``batch_invariant=True`` is a
call's option): the feature runs inside it, stands down for the call (the model's own code runs, through the
invariant linears), or the call is refused (``PatchPlan.batch_invariant_refusal``).
"""

from __future__ import annotations

import difflib
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from actorcore._moved import renamed

# Options renamed because their names misled, old -> new: the old keyword and the old name in a plan still work for
# one release, with a DeprecationWarning ("fused" meant four things; this one compiles the decoder layers; "dense"
# was quack's SwiGLU epilogue).
RENAMED_OPTIONS = {"fused_decoder": "compiled_decoder", "dense_mlp": "swiglu_mlp"}

# What a feature does in a batch-invariant call (``DecoderFeature.in_batch_invariant_call``).
RUNS = "runs"
STANDS_DOWN = "stands down"  # the model's own code runs instead, through the invariant linears


@dataclass(frozen=True)
class PlanFacts:
    """What the options' rules read about the model being patched (the installed packages each probes itself)."""

    model: torch.nn.Module
    spec: Any
    parts: Any  # hf.call.DecoderParts
    parallel: Any

    @property
    def model_name(self) -> str:
        return type(self.model).__name__

    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return torch.device("cpu") if param is None else param.device

    @property
    def dtype(self) -> torch.dtype:
        param = next(self.model.parameters(), None)
        return torch.float32 if param is None else param.dtype


@dataclass(frozen=True)
class Decision:
    """One option resolved: what was asked (``asked``: keyword -> value) and by whom, what runs (``value``: off is
    False, None or 0), on what (``targets``: layer indices or module names, empty where the option acts on the whole
    decoder), and why."""

    option: str
    asked: Mapping[str, Any]
    value: Any
    why: str
    explicit: bool  # asked for (not left to the default)
    targets: tuple = ()
    by: str = "patch_model"

    @property
    def on(self) -> bool:
        return bool(self.value)

    def asked_text(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.asked.items())

    def line(self) -> str:
        if not self.asked:
            who = "reported"
        else:
            who = f"{self.asked_text()}, " + (f"asked by {self.by}" if self.explicit else "default")
        what = repr(self.value) if isinstance(self.value, (str, bool, int, type(None))) else str(self.value)
        if self.targets:
            kind = "layers" if all(isinstance(t, int) for t in self.targets) else "modules"
            what += f" on {len(self.targets)} {kind}"
        return f"{self.option}: {what} ({who}): {self.why}"


@dataclass(frozen=True)
class Conflict:
    """Two options that cannot both hold: declared by the option that resolves second (it names the ``other``)."""

    other: str
    holds: Callable[[Decision, Decision, Mapping[str, Decision], PlanFacts], bool]  # (this option's decision, the
    # other's, every decision so far, the facts): whether they clash
    why: str  # what would be dropped or weakened
    instead: str  # what to pass instead


class FeatureOption:
    """One option of ``patch_model``, owned by a decoder feature (see the module docstring).

    Subclasses set ``name`` (the option's name in the plan: its first keyword), ``keywords`` (keyword -> default;
    empty for a choice the plan reports but no keyword sets), ``needs`` (options whose decisions ``resolve`` reads),
    ``conflicts`` and ``doc`` (its paragraph of ``patch_model``'s docstring), and write ``resolve``.
    """

    name: str = "option"
    keywords: Mapping[str, Any] = {}
    off_value: Any = False  # the value of an "auto" that yields to a conflict
    needs: tuple[str, ...] = ()
    conflicts: tuple[Conflict, ...] = ()
    doc: str = ""

    def explicit(self, asked: Mapping[str, Any]) -> bool:
        """Whether ``asked`` asks for something (any keyword not at its default)."""
        return any(asked[k] is not d and asked[k] != d for k, d in self.keywords.items())

    def resolve(self, asked: Mapping[str, Any], facts: PlanFacts, decided: Mapping[str, Decision]) -> Decision:
        """Check ``asked`` (``ValueError`` saying what was wrong and what to pass) and decide; ``decided`` holds the
        decisions of ``needs``."""
        raise NotImplementedError

    def decision(self, asked: Mapping[str, Any], value: Any, why: str, targets: Iterable = ()) -> Decision:
        return Decision(self.name, dict(asked), value, why, self.explicit(asked), tuple(targets))

    def yielded(self, decision: Decision, why: str) -> Decision:
        """This option's decision when its ``"auto"`` gives way to a conflict: off."""
        return Decision(self.name, decision.asked, self.off_value, why, False, (), decision.by)


@dataclass(frozen=True)
class PatchPlan:
    """Every option of a patch resolved (``Decision`` s in resolution order) and what a batch-invariant call does
    with each active feature. ``str(plan)`` is the table ``handle.plan`` prints."""

    model_name: str
    decisions: tuple[Decision, ...]
    batch_invariant: tuple[tuple[str, str], ...] = ()  # (feature, STANDS_DOWN or why such a call is refused)
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({d.option: d for d in self.decisions})

    def __getitem__(self, option: str) -> Decision:
        if option in RENAMED_OPTIONS:
            renamed(f"the option {option!r}", repr(RENAMED_OPTIONS[option]))
            option = RENAMED_OPTIONS[option]
        if option not in self._index:
            raise KeyError(f"no option {option!r} in this plan; it has {sorted(self._index)}")
        return self._index[option]

    def __contains__(self, option: str) -> bool:
        return RENAMED_OPTIONS.get(option, option) in self._index

    def value(self, option: str) -> Any:
        return self[option].value

    def targets(self, option: str) -> tuple:
        return self[option].targets

    @property
    def batch_invariant_refusal(self) -> str | None:
        """Why a batch-invariant call on this patch is refused (None: it runs)."""
        return next((how for _, how in self.batch_invariant if how not in (RUNS, STANDS_DOWN)), None)

    def stands_down_in_batch_invariant_calls(self) -> tuple[str, ...]:
        return tuple(name for name, how in self.batch_invariant if how == STANDS_DOWN)

    def __str__(self) -> str:
        lines = [f"actorcore patch plan of {self.model_name}:"]
        lines += [f"  {d.line()}" for d in self.decisions]
        invariant = "; ".join(f"{n} {how}" for n, how in self.batch_invariant) or "every feature runs"
        lines.append(f"  in a batch-invariant call: {invariant}")
        return "\n".join(lines)


def check_choice(keyword: str, value: Any, choices: tuple, hint: str = "") -> None:
    """``value`` must be one of ``choices`` (True and False by identity: 1 and 0 are not them); else a
    ``ValueError`` listing them (and ``hint``: what they do)."""
    if not any(value is c if isinstance(c, bool) else isinstance(value, str) and value == c for c in choices):
        names = [repr(c) for c in choices]
        raise ValueError(f"{keyword} must be {', '.join(names[:-1])} or {names[-1]}, got {value!r}"
                         + (f" ({hint})" if hint else ""))


def refusal(this: Decision, other: Decision, conflict: Conflict) -> ValueError:
    return ValueError(f"{this.asked_text()} and {other.asked_text()} cannot both hold: {conflict.why}; pass "
                      f"{conflict.instead}")


def after_their_dependencies(items: list, dependencies: Callable[[Any], tuple[str, ...]], what: str) -> list:
    """``items`` (each with a ``name``) in their given order, each moved after the items its ``dependencies`` name
    (stable); a name no item has, or a cycle, is an error (``what``: the items, for it)."""
    by_name = {item.name: item for item in items}
    done: list = []
    visiting: set[str] = set()

    def visit(item: Any) -> None:
        if item in done:
            return
        if item.name in visiting:
            raise ValueError(f"the {what} depend on one another in a cycle through {item.name!r}")
        visiting.add(item.name)
        for name in dependencies(item):
            if name not in by_name:
                raise ValueError(f"{what}: {item.name!r} comes after {name!r}, which is not listed")
            visit(by_name[name])
        visiting.discard(item.name)
        done.append(item)

    for item in items:
        visit(item)
    return done


def resolution_order(options: list[FeatureOption]) -> list[FeatureOption]:
    """The options in an order where each comes after those it needs or declares a conflict with (stable)."""
    return after_their_dependencies(options, lambda o: (*o.needs, *(c.other for c in o.conflicts)), "options")


def split_keywords(options: list[FeatureOption], given: Mapping[str, Any], function: str = "patch_model"
                   ) -> dict[str, dict[str, Any]]:
    """``given`` keywords per option (defaults filled in); an unknown keyword is a ``TypeError`` naming the
    closest one; a renamed one (``RENAMED_OPTIONS``) is taken under its new name, with a DeprecationWarning."""
    owner = {k: o.name for o in options for k in o.keywords}
    given = dict(given)
    for old, new in RENAMED_OPTIONS.items():
        if old in given and new in owner:
            if new in given:
                raise TypeError(f"{function}() got {old}= and {new}=, the same option under its old and new name; "
                                f"pass {new}= only")
            renamed(f"{function}({old}=...)", f"{new}=...", stacklevel=6)  # the caller of patch_model
            given[new] = given.pop(old)
    for keyword in given:
        if keyword not in owner:
            close = difflib.get_close_matches(keyword, owner, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{function}() got an unexpected keyword argument {keyword!r}{hint} (its options: "
                            f"{', '.join(owner)})")
    return {o.name: {k: given.get(k, d) for k, d in o.keywords.items()} for o in options}


def build_plan(features: Iterable[Any], facts: PlanFacts, given: Mapping[str, Any], by: str = "patch_model",
               reasons: Mapping[str, str] | None = None) -> PatchPlan:
    """Resolve every feature's options for ``given`` keywords (``by``: who asked, e.g. an integration, whose
    ``reasons`` say why it asks for an option) and check their conflicts; ``ValueError`` / ``TypeError`` before
    anything is installed."""
    features = list(features)
    options = [o for f in features for o in f.options]
    asked = split_keywords(options, given)
    reasons = dict(reasons or {})
    decided: dict[str, Decision] = {}
    for option in resolution_order(options):
        decision = option.resolve(asked[option.name], facts, decided)
        if decision.explicit and by != "patch_model":
            why = reasons.get(option.name)
            decision = Decision(decision.option, decision.asked, decision.value,
                                f"{why}; {decision.why}" if why else decision.why, True, decision.targets, by)
        for conflict in option.conflicts:
            other = decided[conflict.other]
            if not conflict.holds(decision, other, decided, facts):
                continue
            if decision.explicit and other.explicit:
                raise refusal(decision, other, conflict)
            if decision.explicit:  # the other side was decided by its own "auto" rule: say so, do not drop it
                raise ValueError(f"{decision.asked_text()}: {conflict.why}, and {other.option}='auto' resolved to "
                                 f"{other.value!r} here ({other.why}); pass {conflict.instead}")
            decision = option.yielded(decision, f"auto: {conflict.why} ({other.asked_text()} was asked)")
        decided[option.name] = decision
    ordered = tuple(decided[o.name] for o in options)
    invariant = tuple((f.name, how) for f in features if f.options and any(decided[o.name].on for o in f.options)
                      for how in [f.in_batch_invariant_call(decided)] if how != RUNS)
    return PatchPlan(type(facts.model).__name__, ordered, invariant)


def option_keywords(features: Iterable[Any]) -> dict[str, Any]:
    """Every keyword the features' options take, with its default (``patch_model``'s keyword arguments)."""
    return {k: d for f in features for o in f.options for k, d in o.keywords.items()}


def options_doc(features: Iterable[Any]) -> str:
    """The options' paragraphs, in feature order (``patch_model``'s docstring)."""
    return "\n\n".join(textwrap.fill(f"``{', '.join(o.keywords)}``: {o.doc}", width=116, initial_indent="    ",
                                     subsequent_indent="    ")
                       for f in features for o in f.options if o.keywords and o.doc)
