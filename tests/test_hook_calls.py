"""The typed hook calls (core/hook_calls.py): one per hookspec, with the spec's parameters and
types, behaving as ``call_first`` / ``call_all``.

Every test walks core/hookspecs.py, so a hook added without its typed call, or a call that
drifts from its spec, fails here. The plugin manager is built without the built-in plugins:
what answers is the test's own plugin, and nothing imports torch.
"""

from __future__ import annotations

import inspect
import types

import pytest

from weft.core import hook_calls, hookspecs
from weft.core.errors import HookError, PluginError, WeftError
from weft.core.hookspecs import hookimpl
from weft.core.plugin_manager import BUILTIN_PLUGINS, WeftPluginManager, build_plugin_manager


def specs() -> dict[str, object]:
    return {name: fn for name, fn in vars(hookspecs).items()
            if callable(fn) and getattr(fn, f"{hookspecs.PROJECT}_spec", None) is not None}


def firstresult(spec: object) -> bool:
    return bool(getattr(spec, f"{hookspecs.PROJECT}_spec").get("firstresult"))


def called() -> dict[str, object]:
    """The hooks the core calls, with their specs: every hook but those the manager collects itself."""
    return {name: spec for name, spec in specs().items() if name not in hook_calls.COLLECTED}


def typed(name: str):
    return getattr(WeftPluginManager, name.removeprefix("weft_"))


def arguments(spec: object) -> dict[str, object]:
    """A stand-in for each of the spec's arguments; the decision names a strategy nobody owns."""
    return {name: (types.SimpleNamespace(strategy="nobody") if name == "decision" else object())
            for name in inspect.signature(spec).parameters}


def plugin(behaviour) -> object:
    """A plugin implementing every hook with ``behaviour(hook_name)``, taking none of its arguments
    (pluggy passes an implementation only those it names)."""
    def implementation(name: str):
        def weft_hook():
            return behaviour(name)
        weft_hook.__name__ = name
        return hookimpl(weft_hook)
    return types.SimpleNamespace(**{name: implementation(name) for name in specs()})


def manager(*plugins: tuple[str, object]) -> WeftPluginManager:
    return build_plugin_manager(block=BUILTIN_PLUGINS, extra=plugins, entry_points=False)


def test_each_hookspec_has_its_typed_call_with_the_spec_s_parameters_and_types():
    assert set(hook_calls.COLLECTED) <= set(specs())
    public = {name for name, fn in vars(hook_calls.HookCalls).items() if inspect.isfunction(fn)
              and not name.startswith("_") and name not in ("call_all", "call_first")}
    assert public == {name.removeprefix("weft_") for name in called()}, "a typed call without its hookspec"
    for name, spec in called().items():
        assert hasattr(WeftPluginManager, name.removeprefix("weft_")), f"{name} has no typed call in core/hook_calls.py"
        want = inspect.signature(spec)
        got = inspect.signature(typed(name))
        params = [p for p in got.parameters.values() if p.name != "self"]
        assert all(p.kind is p.KEYWORD_ONLY for p in params), f"{name}: its typed call's arguments are keyword-only"
        assert [(p.name, p.annotation) for p in params] == [(p.name, p.annotation) for p in want.parameters.values()]
        answer = want.return_annotation.removesuffix(" | None")
        expected = answer if firstresult(spec) or answer == "None" else f"list[{answer}]"
        assert got.return_annotation == expected, name


def test_a_typed_call_passes_its_arguments_to_its_own_hook_and_returns_the_answer():
    seen: list[tuple[str, dict]] = []
    pm = manager(("answers", plugin(lambda name: f"answer of {name}")))
    pm.add_hookcall_monitoring(lambda hook, impls, kwargs: seen.append((hook, dict(kwargs))), lambda *a: None)
    for name, spec in called().items():
        kwargs = arguments(spec)
        result = typed(name)(pm, **kwargs)
        assert seen.pop() == (name, kwargs)
        if firstresult(spec):
            assert result == pm.call_first(name, **kwargs) == f"answer of {name}"
        elif inspect.signature(typed(name)).return_annotation == "None":
            assert result is None
        else:
            assert result == pm.call_all(name, **kwargs) == [f"answer of {name}"]


def test_nobody_answering_a_typed_firstresult_call_is_call_first_s_hook_error():
    pm = manager()
    for name, spec in called().items():
        kwargs = arguments(spec)
        if not firstresult(spec):
            assert typed(name)(pm, **kwargs) in ([], None)  # collect-all: nobody answering is no error
            continue
        with pytest.raises(HookError) as raised:
            typed(name)(pm, **kwargs)
        assert str(raised.value) == (f"no plugin answered hook {name} for strategy 'nobody'; "
                                     "registered plugins: (none)")
        with pytest.raises(HookError) as direct:
            pm.call_first(name, **kwargs)
        assert str(direct.value) == str(raised.value)


def test_a_plugin_raising_in_a_typed_call_is_named_as_call_all_names_it():
    def boom(name: str):
        raise ValueError(f"boom in {name}\nsecond line")

    pm = manager(("raiser", plugin(boom)))
    for name, spec in called().items():
        kwargs = arguments(spec)
        with pytest.raises(PluginError) as raised:
            typed(name)(pm, **kwargs)
        error = raised.value
        assert error.plugin == "raiser" and error.where == name
        assert error.message == (f"plugin 'raiser' ((registered in-process)) raised ValueError in hook {name}: "
                                 f"boom in {name} (traceback in the run's log.jsonl; WEFT_DEBUG=1 prints it)")
        assert isinstance(error.__cause__, ValueError)
        with pytest.raises(PluginError) as direct:
            pm.call_all(name, **kwargs)
        assert str(direct.value) == str(error)


def test_a_typed_call_lets_out_of_memory_and_weft_errors_through():
    class OutOfMemoryError(RuntimeError):  # torch's, known by its name: the loop gives its own message
        pass

    raised = {"weft_shard": OutOfMemoryError("CUDA out of memory"), "weft_batching": WeftError("a message")}

    def behaviour(name: str):
        if name in raised:
            raise raised[name]

    pm = manager(("raiser", plugin(behaviour)))
    for name, error in raised.items():
        with pytest.raises(type(error)) as caught:
            typed(name)(pm, **arguments(specs()[name]))
        assert caught.value is error
