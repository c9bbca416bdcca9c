"""Finds code that changes objects of the libraries ccq-eval runs on (tests/test_code_rules.py).

What counts as a library object: the modules of lm_eval, tqdm, transformers, triton and fla, everything
reached from them by attribute, item or iteration (their classes, functions, module dicts, registries),
the loggers named after them (`logging.getLogger("lm_eval")`) and the modules found by name at run time
(`sys.modules.get("tqdm.std")`, `importlib.import_module("fla.ops")`). An object made by calling a library
class or function is the caller's own (a model ccq-eval builds or loads, a config, a progress bar): this
is how tests/model/test_fla_untouched.py defines "fla untouched": every attribute of fla's modules, every
member of fla's classes and every entry of fla's module dicts stays the object it was, while the models
ccq-eval builds are its own to change.

A change is an assignment or `del` of an attribute or item of a library object (`tqdm.std.tqdm.__init__ =
...`, `logger.handlers = [...]` on lm-eval's logger, `ACT2FN["x"] = ...`), `setattr` / `delattr` /
`object.__setattr__` on one, a mutating method called on one (`vars(tuner).pop(...)`,
`logger.handlers.clear()`), and any change of `sys.modules`. The module's public calls (a logger's
`setLevel`, `AutoConfig.register`, `transformers.utils.logging.disable_progress_bar()`) are not changes.
`unittest.mock`, the `mock` package and pytest's MonkeyPatch are patching tools: any use of them counts.

The analysis is an abstract interpretation over the whole set of modules given, iterated to a fixed
point: each name (in its scope), each `self.<attribute>` of a class, each function's parameters (from
its call sites in the set) and its return value hold a value that is "a library object", "a container
of ours holding library objects" or neither, with the string constants it may hold (a logger or module
name). It does not follow objects through attributes of other objects of ours or through calls it
cannot resolve to a function in the set.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

LIBRARIES = ("lm_eval", "lm-eval", "tqdm", "transformers", "triton", "fla", "fla_core")
MOCK_MODULES = ("unittest.mock", "mock", "_pytest.monkeypatch")
NONE, HOLDS, LIB = 0, 1, 2  # neither; a container of ours holding library objects; a library object

# Methods that return a part of their receiver (a library object's part is the library's).
PART_METHODS = {"get", "items", "values", "setdefault", "pop", "popitem", "copy", "get_logger", "getLogger",
                "getChild", "__getattribute__", "__getattr__", "__getitem__"}
# Methods that change their receiver.
MUTATORS = {"update", "append", "extend", "insert", "pop", "popitem", "clear", "setdefault", "remove", "discard",
            "add", "sort", "reverse", "__setitem__", "__delitem__", "__setattr__", "__delattr__"}
# Builtins whose result is a new container of the argument's elements, or the argument itself.
CONTAINER_BUILTINS = {"list", "tuple", "sorted", "set", "frozenset", "dict", "reversed", "enumerate", "zip",
                      "filter", "iter", "map"}
SAME_OBJECT_CALLS = {"getattr", "vars", "type", "next", "inspect.unwrap", "inspect.getmodule",
                     "operator.attrgetter", "object.__getattribute__", "importlib.reload"}
SETTERS = {"setattr", "delattr", "object.__setattr__", "object.__delattr__", "type.__setattr__",
           "type.__delattr__"}


def is_library_name(name: str) -> bool:
    """A module or logger name of one of LIBRARIES (`lm_eval`, `lm-eval.tasks`, `fla.ops`...)."""
    return name.split(".")[0] in LIBRARIES


@dataclass(frozen=True)
class Value:
    level: int = NONE
    strings: frozenset = frozenset()

    def join(self, other: Value) -> Value:
        return Value(max(self.level, other.level), self.strings | other.strings)

    def element(self) -> Value:
        """What iterating or indexing this value gives."""
        return Value(LIB if self.level else NONE, self.strings)

    def names_library(self, unknown_is_library: bool) -> bool:
        """Whether a name this value may hold is a library's (or, with no known string, whether to assume so)."""
        if not self.strings:
            return unknown_is_library
        return any(is_library_name(text) for text in self.strings)


EMPTY = Value()


@dataclass
class Scope:
    node: ast.AST
    module: str
    parent: Scope | None
    qualname: str
    class_name: str | None = None  # the class a method belongs to
    bound: set = field(default_factory=set)
    values: dict = field(default_factory=dict)
    imports: dict = field(default_factory=dict)  # name -> dotted module path (or module.attribute) it binds
    functions: dict = field(default_factory=dict)  # name -> function key, for defs in this scope


@dataclass(frozen=True)
class Finding:
    module: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.text}"


def _function_nodes(node: ast.AST):
    """The nodes below `node`, without descending into nested functions or lambdas (which are yielded,
    their insides not); class bodies belong to the enclosing scope."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _function_nodes(child)


def _scope_items(node: ast.AST):
    """The nodes that run in the scope of `node` (a module, function or lambda)."""
    if isinstance(node, ast.Lambda):
        yield node.body
        yield from _function_nodes(node.body)
    else:
        yield from _function_nodes(node)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class Analysis:
    """Library objects and their changes in a set of modules {module name: source}."""

    def __init__(self, sources: dict[str, str], packages: frozenset = frozenset()):
        self.trees = {name: ast.parse(source) for name, source in sources.items()}
        self.packages = packages  # the modules in `sources` that are packages (their __init__)
        self.parents: dict[str, dict] = {}
        self.scopes: dict[ast.AST, Scope] = {}
        self.function_scopes: dict[str, Scope] = {}  # function key "module:qualname" -> its scope
        self.module_scopes: dict[str, Scope] = {}
        self.returns: dict[str, Value] = {}
        self.params: dict[tuple[str, str], Value] = {}
        self.attributes: dict[tuple[str, str, str], Value] = {}  # (module, class qualname, attribute)
        self.changed = True
        for module, tree in self.trees.items():
            self._collect(tree, module, None, "", None)
        while self.changed:
            self.changed = False
            for scope in self.scopes.values():
                self._bind(scope)

    # --- scopes and bindings -------------------------------------------------------------------------

    def _collect(self, node: ast.AST, module: str, parent: Scope | None, qualname: str,
                 class_name: str | None) -> None:
        """A scope for `node` (a module, function or lambda) and, recursively, for those inside it."""
        scope = Scope(node, module, parent, qualname, class_name)
        self.scopes[node] = scope
        if parent is None:
            self.module_scopes[module] = scope
            self.parents[module] = {child: outer for outer in ast.walk(node)
                                    for child in ast.iter_child_nodes(outer)}
        else:
            self.function_scopes[f"{module}:{qualname}"] = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                        arguments.kwarg]:
                if arg is not None:
                    scope.bound.add(arg.arg)
        items = list(_scope_items(node))
        declared_global = {name for item in items if isinstance(item, ast.Global) for name in item.names}
        for item in items:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                classes = self._classes_between(module, node, item)
                name = item.name if not isinstance(item, ast.Lambda) else f"<lambda:{item.lineno}:{item.col_offset}>"
                inner = ".".join(part for part in (qualname, *classes, name) if part)
                if not classes and not isinstance(item, ast.Lambda):
                    scope.bound.add(item.name)
                    scope.functions[item.name] = f"{module}:{inner}"
                self._collect(item, module, scope, inner, classes[-1] if classes else None)
            elif isinstance(item, ast.ClassDef):
                scope.bound.add(item.name)
            elif isinstance(item, ast.Name) and isinstance(item.ctx, (ast.Store, ast.Del)):
                (self._module_scope_of(scope) if item.id in declared_global else scope).bound.add(item.id)
            elif isinstance(item, ast.ExceptHandler) and item.name:
                scope.bound.add(item.name)
            elif isinstance(item, (ast.Import, ast.ImportFrom)):
                self._record_import(item, scope, module)

    def _classes_between(self, module: str, outer: ast.AST, function: ast.AST) -> list[str]:
        """The names of the classes whose bodies hold `function` inside the scope `outer`, outermost first."""
        names = []
        node = self.parents[module].get(function)
        while node is not None and node is not outer:
            if isinstance(node, ast.ClassDef):
                names.append(node.name)
            node = self.parents[module].get(node)
        return names[::-1]

    def _module_scope_of(self, scope: Scope) -> Scope:
        while scope.parent is not None:
            scope = scope.parent
        return scope

    def _record_import(self, node: ast.Import | ast.ImportFrom, scope: Scope, module: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                scope.bound.add(name)
                scope.imports[name] = alias.name if alias.asname else alias.name.split(".")[0]
            return
        base = node.module or ""
        if node.level:
            parts = module.split(".") + ([""] if module in self.packages else [])
            base = ".".join(parts[: len(parts) - node.level] + ([base] if base else []))
        for alias in node.names:
            name = alias.asname or alias.name
            scope.bound.add(name)
            scope.imports[name] = f"{base}.{alias.name}" if base else alias.name

    def _set(self, scope: Scope, name: str, value: Value) -> None:
        owner = scope
        while owner is not None and name not in owner.bound:
            owner = owner.parent
        owner = owner or scope
        old = owner.values.get(name, EMPTY)
        new = old.join(value)
        if new != old:
            owner.values[name] = new
            self.changed = True

    def _join_into(self, table: dict, key, value: Value) -> None:
        old = table.get(key, EMPTY)
        new = old.join(value)
        if new != old:
            table[key] = new
            self.changed = True

    def _bind(self, scope: Scope) -> None:
        """One pass over the scope's nodes: what each name, parameter and return may hold."""
        node = scope.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            key = f"{scope.module}:{scope.qualname}"
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
            keyword_defaults = list(arguments.kw_defaults)
            for arg, default in [*zip(positional, defaults, strict=True),
                                 *zip(arguments.kwonlyargs, keyword_defaults, strict=True)]:
                value = self.params.get((key, arg.arg), EMPTY)
                if default is not None:
                    value = value.join(self.value(default, scope.parent))
                self._set(scope, arg.arg, value)
            if isinstance(node, ast.Lambda):
                self._join_into(self.returns, key, self.value(node.body, scope))
        for name, target in scope.imports.items():
            self._set(scope, name, self._import_value(target))
        for item in _scope_items(node):
            self._bind_item(item, scope)

    def _import_value(self, target: str) -> Value:
        if is_library_name(target):
            return Value(LIB)
        module, _, name = target.rpartition(".")
        source = self.module_scopes.get(module)
        if source is not None and name in source.values:
            return source.values[name]
        return EMPTY

    def _bind_item(self, item: ast.AST, scope: Scope) -> None:
        if isinstance(item, ast.Assign):
            for target in item.targets:
                self._assign(target, item.value, self.value(item.value, scope), scope)
        elif isinstance(item, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and item.value is not None:
            self._assign(item.target, item.value, self.value(item.value, scope), scope)
        elif isinstance(item, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._assign(item.target, None, self.value(item.iter, scope).element(), scope)
        elif isinstance(item, ast.withitem) and item.optional_vars is not None:
            self._assign(item.optional_vars, None, self.value(item.context_expr, scope), scope)
        elif isinstance(item, (ast.Return, ast.Yield, ast.YieldFrom)) and item.value is not None:
            value = self.value(item.value, scope)
            if isinstance(item, ast.Yield):  # a generator: a container of what it yields
                value = Value(HOLDS if value.level else NONE, value.strings)
            self._join_into(self.returns, f"{scope.module}:{scope.qualname}", value)
        elif isinstance(item, ast.Call):
            self._bind_call(item, scope)

    def _assign(self, target: ast.AST, source: ast.AST | None, value: Value, scope: Scope) -> None:
        if isinstance(target, ast.Name):
            self._set(scope, target.id, value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            literal = isinstance(source, (ast.Tuple, ast.List)) and len(source.elts) == len(target.elts)
            for index, element in enumerate(target.elts):
                if literal:
                    self._assign(element, source.elts[index], self.value(source.elts[index], scope), scope)
                else:
                    self._assign(element.value if isinstance(element, ast.Starred) else element, None,
                                 value.element(), scope)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and value.level:
            self._set(scope, target.value.id, Value(HOLDS))  # a container of ours now holds library objects
        elif isinstance(target, ast.Attribute) and self._is_self(target.value, scope):
            self._join_into(self.attributes, (scope.module, self._class_qualname(scope), target.attr), value)

    def _method_scope(self, scope: Scope) -> Scope | None:
        """The method `scope` is in (itself or a function inside it), None outside classes."""
        while scope is not None and scope.class_name is None:
            scope = scope.parent
        return scope

    def _class_qualname(self, scope: Scope) -> str:
        return self._method_scope(scope).qualname.rpartition(".")[0]

    def _is_self(self, node: ast.AST, scope: Scope) -> bool:
        return isinstance(node, ast.Name) and node.id == "self" and self._method_scope(scope) is not None

    def _bind_call(self, call: ast.Call, scope: Scope) -> None:
        """Arguments flow into the parameters of a function of the set; a library object put into a
        container of ours makes it a holder."""
        key = self.function_key(call.func, scope)
        if key is not None and key in self.function_scopes:
            function = self.function_scopes[key].node
            arguments = function.args
            names = [arg.arg for arg in arguments.posonlyargs + arguments.args]
            if names and names[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
                names = names[1:]
            for name, argument in zip(names, call.args, strict=False):
                self._join_into(self.params, (key, name), self.value(argument, scope))
            for keyword in call.keywords:
                if keyword.arg is not None:
                    self._join_into(self.params, (key, keyword.arg), self.value(keyword.value, scope))
        func = call.func
        if (isinstance(func, ast.Attribute) and func.attr in MUTATORS and isinstance(func.value, ast.Name)
                and any(self.value(argument, scope).level for argument in call.args)):
            self._set(scope, func.value.id, Value(HOLDS))

    def function_key(self, func: ast.AST, scope: Scope) -> str | None:
        """The function of the set that a call of `func` runs, when it can be told."""
        if isinstance(func, ast.Name):
            owner = scope
            while owner is not None and func.id not in owner.bound:
                owner = owner.parent
            if owner is None:
                return None
            if func.id in owner.functions:
                return owner.functions[func.id]
            target = owner.imports.get(func.id)
            if target:
                module, _, name = target.rpartition(".")
                return f"{module}:{name}"
            return None
        if isinstance(func, ast.Attribute):
            if self._is_self(func.value, scope):
                return f"{scope.module}:{self._class_qualname(scope)}.{func.attr}"
            base = self.resolve(func.value, scope)
            if base and base in self.module_scopes:
                return f"{base}:{func.attr}"
        return None

    # --- values --------------------------------------------------------------------------------------

    def resolve(self, node: ast.AST, scope: Scope) -> str | None:
        """The dotted import path an expression such as `logging.getLogger` names, if it starts at an import."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        owner = scope
        while owner is not None and head not in owner.bound:
            owner = owner.parent
        if owner is None:
            return dotted  # a builtin (getattr, setattr, object.__setattr__)
        target = owner.imports.get(head)
        if target is None:
            return None
        return f"{target}.{rest}" if rest else target

    def name_value(self, name: str, scope: Scope) -> Value:
        owner = scope
        while owner is not None and name not in owner.bound:
            owner = owner.parent
        return EMPTY if owner is None else owner.values.get(name, EMPTY)

    def value(self, node: ast.AST | None, scope: Scope) -> Value:
        if node is None:
            return EMPTY
        if isinstance(node, ast.Constant):
            return Value(NONE, frozenset([node.value])) if isinstance(node.value, str) else EMPTY
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                return Value(NONE, frozenset([head.value]))
            return EMPTY
        if isinstance(node, ast.Name):
            return self.name_value(node.id, scope)
        if isinstance(node, ast.Attribute):
            if self.resolve(node, scope) == "sys.modules":
                return Value(HOLDS)
            if self._is_self(node.value, scope):
                return self._self_attribute(node.attr, scope)
            base = self.value(node.value, scope)
            return Value(LIB) if base.level == LIB else EMPTY
        if isinstance(node, ast.Subscript):
            if self.resolve(node.value, scope) == "sys.modules":
                return Value(LIB) if self.value(node.slice, scope).names_library(True) else EMPTY
            return self.value(node.value, scope).element()
        if isinstance(node, ast.Call):
            return self._call_value(node, scope)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return self._container(node.elts, scope)
        if isinstance(node, ast.Dict):
            return self._container([value for value in node.values if value is not None], scope)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self._container([node.elt], scope)
        if isinstance(node, ast.DictComp):
            return self._container([node.value], scope)
        if isinstance(node, ast.IfExp):
            return self.value(node.body, scope).join(self.value(node.orelse, scope))
        if isinstance(node, ast.BoolOp):
            result = EMPTY
            for operand in node.values:
                result = result.join(self.value(operand, scope))
            return result
        if isinstance(node, (ast.NamedExpr, ast.Starred, ast.Await)):
            return self.value(node.value, scope)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.value(node.left, scope)
        return EMPTY

    def _self_attribute(self, attribute: str, scope: Scope) -> Value:
        return self.attributes.get((scope.module, self._class_qualname(scope), attribute), EMPTY)

    def _container(self, elements: list, scope: Scope) -> Value:
        result = EMPTY
        for element in elements:
            result = result.join(self.value(element, scope))
        return Value(HOLDS if result.level else NONE, result.strings)

    def _call_value(self, call: ast.Call, scope: Scope) -> Value:
        func = call.func
        name = self.resolve(func, scope)
        first = self.value(call.args[0], scope) if call.args else EMPTY
        if name in ("logging.getLogger", "logging.Logger.manager.getLogger"):
            return Value(LIB) if call.args and first.names_library(False) else EMPTY
        if name in ("importlib.import_module", "__import__"):
            return Value(LIB) if first.names_library(True) else EMPTY
        if name in SAME_OBJECT_CALLS:
            return Value(LIB) if first.level == LIB else first.element() if first.level else EMPTY
        if name in CONTAINER_BUILTINS:
            joined = EMPTY
            for argument in call.args:
                joined = joined.join(self.value(argument, scope))
            return Value(HOLDS if joined.level else NONE, joined.strings)
        if isinstance(func, ast.Attribute):
            if self.resolve(func.value, scope) == "sys.modules":
                if func.attr in ("get", "pop", "setdefault"):
                    return Value(LIB) if first.names_library(True) else EMPTY
                return Value(HOLDS) if func.attr in ("items", "values", "copy") else EMPTY
            receiver = self.value(func.value, scope)
            if receiver.level and func.attr in PART_METHODS:
                if receiver.level == LIB:
                    return Value(LIB)
                return Value(HOLDS) if func.attr in ("items", "values", "copy") else Value(LIB)
        key = self.function_key(func, scope)
        if key is not None:
            return self.returns.get(key, EMPTY)
        return EMPTY

    # --- findings ------------------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        for scope in self.scopes.values():
            for item in _scope_items(scope.node):
                found.extend(self._item_findings(item, scope))
        return sorted(set(found), key=lambda finding: (finding.module, finding.line, finding.text))

    def _item_findings(self, item: ast.AST, scope: Scope) -> list[Finding]:
        def finding(text: str) -> list[Finding]:
            return [Finding(scope.module, item.lineno, text)]

        if isinstance(item, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = item.targets if isinstance(item, (ast.Assign, ast.Delete)) else [item.target]
            result = []
            for target in targets:
                for part in ast.walk(target):
                    if (isinstance(part, (ast.Attribute, ast.Subscript)) and isinstance(part.ctx, (ast.Store, ast.Del))
                            and self._changes_library(part, scope)):
                        verb = "deletes" if isinstance(item, ast.Delete) else "assigns"
                        result += finding(f"{verb} {ast.unparse(part)}, part of a library object")
            return result
        if isinstance(item, ast.Call):
            name = self.resolve(item.func, scope)
            if name in SETTERS and item.args and self.value(item.args[0], scope).level == LIB:
                return finding(f"{name}() on a library object: {ast.unparse(item)[:80]}")
            if isinstance(item.func, ast.Attribute) and item.func.attr in MUTATORS:
                if self.resolve(item.func.value, scope) == "sys.modules":
                    return finding(f"changes sys.modules: {ast.unparse(item)[:80]}")
                if self.value(item.func.value, scope).level == LIB:
                    return finding(f"changes a library object: {ast.unparse(item)[:80]}")
            if name in ("importlib.import_module", "__import__") and item.args:
                text = self.value(item.args[0], scope)
                if any(text_value.startswith(MOCK_MODULES) for text_value in text.strings):
                    return finding("imports a patching tool (unittest.mock, mock, MonkeyPatch)")
        if isinstance(item, (ast.Import, ast.ImportFrom)):
            imported = [alias.name for alias in item.names] if isinstance(item, ast.Import) else \
                [f"{item.module}.{alias.name}" for alias in item.names] + [item.module or ""]
            if any(path == tool or path.startswith(tool + ".") for path in imported for tool in MOCK_MODULES) \
                    or any(path.endswith(".MonkeyPatch") for path in imported):
                return finding("imports a patching tool (unittest.mock, mock, MonkeyPatch)")
        if isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Load):
            path = self.resolve(item, scope) or ""
            if path in ("unittest.mock", "pytest.MonkeyPatch", "pytest.monkeypatch"):
                return finding(f"uses a patching tool: {path}")
        return []

    def _changes_library(self, target: ast.Attribute | ast.Subscript, scope: Scope) -> bool:
        if isinstance(target, ast.Subscript) and self.resolve(target.value, scope) == "sys.modules":
            return True
        return self.value(target.value, scope).level == LIB


def library_changes(sources: dict[str, str], packages: frozenset = frozenset()) -> list[Finding]:
    """Every change of a library object, and every use of a patching tool, in {module name: source}
    (`packages`: the names in `sources` that are packages, for their relative imports)."""
    return Analysis(sources, packages).findings()
