"""Builds the one plugin manager of a run: built-ins first, then entry points, then checks."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import time
from typing import Any, Iterable

import attrs
import pluggy
import structlog

from weft.core import hookspecs
from weft.core.errors import HookError, PluginError, WeftError
from weft.core.hook_calls import HookCalls
from weft.core.models import ModelFamily, ModelRegistry
from weft.core.registry import Strategy, StrategyRegistry

#: Built-in plugins, one module per hook point plus the model families; registered
#: under these names. The only place the core names modules of weft.plugins.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "weft.plugins.models",
    "weft.plugins.adapter",
    "weft.plugins.shard",
    "weft.plugins.attention",
    "weft.plugins.kv_cache",
    "weft.plugins.rope",
    "weft.plugins.batching",
    "weft.plugins.objective",
    "weft.plugins.grad_sync",
    "weft.plugins.guard",
    "weft.plugins.optimizer",
    "weft.plugins.metrics",
)

ENTRY_POINT_GROUP = "weft"


class WeftPluginManager(HookCalls, pluggy.PluginManager):
    """pluggy's manager plus the strategy registry, weft's firstresult check and the typed
    call of each hook (``pm.shard(...)``, core/hook_calls.py) the core calls them through."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self._registry: StrategyRegistry | None = None
        self._models: ModelRegistry | None = None
        #: (plugin, distribution, error) of plugins whose weft_strategies raised: left out, reported.
        self.broken: list[tuple[str, str, str]] = []
        #: (entry point, distribution, error) of entry points whose module raised on import: left out, reported.
        self.unloaded: list[tuple[str, str, str]] = []
        #: entry-point plugin name -> "distribution version", as loaded (see :func:`_origin`).
        self._origins: dict[str, str] = {}

    @property
    def registry(self) -> StrategyRegistry:
        if self._registry is None:
            self._registry = self._collect_strategies()
        return self._registry

    @property
    def models(self) -> ModelRegistry:
        """Model families by model_type, from every plugin's ``weft_models``."""
        if self._models is None:
            declared: list[tuple[str, ModelFamily]] = []
            for impl in self.hook.weft_models.get_hookimpls():
                declared.extend((impl.plugin_name, family) for family in impl.function() or [])
            self._models = ModelRegistry(declared)
        return self._models

    def _collect_strategies(self) -> StrategyRegistry:
        declared: list[Strategy] = []
        for impl in self.hook.weft_strategies.get_hookimpls():
            try:
                offered = list(impl.function() or [])
            except Exception as error:  # one broken plugin must not take `weft plugins` or `plan` down
                where = self.distribution_of(impl.plugin_name)
                self.broken.append((impl.plugin_name, where, f"{type(error).__name__}: {error}"))
                print(f"weft: plugin {impl.plugin_name!r} ({where}) failed in weft_strategies and is left out: "
                      f"{type(error).__name__}: {error}", file=sys.stderr)
                continue
            declared.extend(attrs.evolve(strategy, plugin=impl.plugin_name) for strategy in offered)
        return StrategyRegistry(declared)

    def call_all(self, hook_name: str, **kwargs: Any) -> list:
        """Call a hook on every plugin; a plugin that raises is named (:class:`PluginError`)."""
        try:
            return getattr(self.hook, hook_name)(**kwargs)
        except WeftError:
            raise  # already a message for the user
        except Exception as error:
            if type(error).__name__ == "OutOfMemoryError":
                raise  # torch's: the loop turns it into its own message (looked up by name: no torch import here)
            raise self._named(hook_name, error) from error

    def call_first(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a firstresult hook and insist on an answer."""
        result = self.call_all(hook_name, **kwargs)
        if result is None:
            decision = kwargs.get("decision")
            strategy = getattr(decision, "strategy", None)
            plugins = ", ".join(self.plugin_names()) or "(none)"
            raise HookError(
                f"no plugin answered hook {hook_name}"
                + (f" for strategy {strategy!r}" if strategy else "")
                + f"; registered plugins: {plugins}"
            )
        return result

    def _named(self, hook_name: str, error: Exception) -> PluginError:
        """The plugin whose hook function is on the error's traceback (the outermost such frame)."""
        impls = {impl.function.__code__: impl.plugin_name
                 for impl in getattr(self.hook, hook_name).get_hookimpls() if hasattr(impl.function, "__code__")}
        tb, plugin = error.__traceback__, None
        while tb is not None and plugin is None:
            plugin = impls.get(tb.tb_frame.f_code)
            tb = tb.tb_next
        who = f"plugin {plugin!r} ({self.distribution_of(plugin)})" if plugin else "a plugin"
        first = (str(error).splitlines() or [""])[0]
        return PluginError(f"{who} raised {type(error).__name__} in hook {hook_name}: {first} "
                           "(traceback in the run's log.jsonl; WEFT_DEBUG=1 prints it)", where=hook_name,
                           plugin=plugin)

    def plugin_names(self) -> list[str]:
        return [name for name, plugin in self.list_name_plugin() if plugin is not None]

    def distribution_of(self, plugin_name: str) -> str:
        """The distribution a plugin came from: 'weft (built-in)' or 'name version'."""
        if plugin_name in self._origins:
            return self._origins[plugin_name]
        return "weft (built-in)" if plugin_name in BUILTIN_PLUGINS else "(registered in-process)"

    def load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        """Import and register one entry point of the ``weft`` group. A module that raises on
        import is left out with one warning naming it (its distribution, the error's first line),
        as a plugin whose weft_strategies raises is: the others, built-ins included, still load,
        and `weft plugins` lists it as left out."""
        origin = _origin(ep)
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as error:  # its own code failed (a missing dependency, a bug, an exit)
            first = (str(error).splitlines() or [""])[0]
            said = f"{type(error).__name__}: {first}" if first else type(error).__name__
            self.unloaded.append((ep.name, origin, said))
            print(f"weft: plugin {ep.name!r} ({origin}) failed to import ({ep.value}) and is left out: {said}",
                  file=sys.stderr)
            return
        self.register(plugin, name=ep.name)
        self._origins[ep.name] = origin


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    """'name version' of the distribution that declares ``ep``; a dist-info without METADATA
    (or one that names neither) is named by the entry point's module: 'module m, unknown version'."""
    dist = getattr(ep, "dist", None)
    metadata = getattr(dist, "metadata", None)
    name = metadata.get("Name") if metadata is not None else None
    version = metadata.get("Version") if metadata is not None else None
    module = ep.value.partition(":")[0].strip()
    return f"{name or f'module {module}'}" + (f" {version}" if version else ", unknown version")


def _names(var: str) -> list[str] | None:
    value = os.environ.get(var)
    return [n.strip() for n in value.split(",") if n.strip()] if value is not None else None


def plugin_manager_from_env() -> WeftPluginManager:
    """The run's plugin manager; the WEFT_* variables are read here and only here:
    WEFT_PLUGINS (entry-point plugins to allow), WEFT_DISABLE_PLUGINS (plugins never
    registered, built-ins included), WEFT_TRACE_HOOKS (log every hook call)."""
    return build_plugin_manager(
        allow=_names("WEFT_PLUGINS"),
        block=_names("WEFT_DISABLE_PLUGINS") or (),
        trace=os.environ.get("WEFT_TRACE_HOOKS", "") not in ("", "0"),
    )


def build_plugin_manager(
    *,
    allow: Iterable[str] | None = None,
    block: Iterable[str] = (),
    trace: bool = False,
    extra: Iterable[tuple[str, object]] = (),
    entry_points: bool = True,
    log: Any = None,
) -> WeftPluginManager:
    """Make the run's plugin manager.

    ``allow``: when given, only these entry-point plugins load (built-ins always do,
    unless blocked). ``block``: plugin names never registered, built-ins included.
    ``trace``: log every hook call with rank and duration. ``extra``: (name, plugin)
    pairs registered after the built-ins, as tests and embedding programs do.
    """
    # Never the stdout default: `weft plan --json` prints its object there.
    log = log if log is not None else structlog.wrap_logger(structlog.PrintLogger(sys.stderr))
    blocked = set(block)
    allowed = set(allow) if allow is not None else None
    pm = WeftPluginManager()
    for module_name in BUILTIN_PLUGINS:
        if module_name not in blocked:
            pm.register(importlib.import_module(module_name), name=module_name)
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in blocked or (allowed is not None and ep.name not in allowed):
                log.info("plugin.skipped", plugin=ep.name, reason="blocked" if ep.name in blocked else "not allowed")
                continue
            if pm.get_plugin(ep.name) is None and ep.name not in (name for name, _, _ in pm.unloaded):
                pm.load_entry_point(ep)
    for name, plugin in extra:
        if name not in blocked:
            pm.register(plugin, name=name)
    pm.check_pending()
    if trace:
        _install_trace(pm, log)
    return pm


def _install_trace(pm: WeftPluginManager, log: Any) -> None:
    starts: list[float] = []

    def before(hook_name: str, hook_impls: list, kwargs: dict) -> None:
        starts.append(time.perf_counter())

    def after(outcome: Any, hook_name: str, hook_impls: list, kwargs: dict) -> None:
        duration = time.perf_counter() - starts.pop()
        log.info(
            "hook.call",
            hook=hook_name,
            rank=_rank(),
            plugins=[impl.plugin_name for impl in hook_impls],
            duration_ms=round(duration * 1000, 3),
        )

    pm.add_hookcall_monitoring(before, after)


def _rank() -> int:
    # Looked up, not imported: building a plugin manager must not import torch.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
