"""An OCSF event validator, compiled from the published schema files. Pure: the schema's
files in (a mapping from their paths to their parsed JSON), findings out.

It follows the rules the OCSF server applies (its ``validator2``), written from the schema's
own conventions, not copied:

* **compile**: a class or object ``extends`` its parent (attributes deep-merged, the child's
  keys win, so enums are unioned); ``$include`` pulls in ``includes/`` and ``profiles/``
  files, and an attribute that comes from a profile carries that profile's name unless the
  class says ``"profile": null``; each attribute takes its type, ``is_array``, enum and
  sibling from ``dictionary.json`` unless the class overrides them; ``constraints`` are
  inherited unless redefined; a class's uid is ``category_uid * 1000 + uid``; ``type_uid``'s
  enum is ``class_uid * 100 + activity_id`` for each activity;
* **validate**: ``class_uid`` names a class; only the attributes of the profiles the event
  declares in ``metadata.profiles`` exist; a required attribute must be present (a missing
  recommended one is a warning); an attribute the class or object does not define is an error
  except inside an open object (``unmapped``: type ``object``); values have their dictionary
  type (integer_t 32-bit, long_t 64-bit, float_t a float, string_t with its subtype's
  ``max_len``, ``regex`` and ``values``, a range), enums hold a defined value (a sibling
  caption that disagrees is a warning), ``constraints`` (``at_least_one``, ``just_one``) hold
  on classes and objects, ``type_uid = class_uid * 100 + activity_id``, and
  ``metadata.version`` is semantic and not newer than the schema.

``compile_schema`` takes ``{path: json}`` for every file of a schema directory (``events/…``,
``objects/…``, ``profiles/…``, ``includes/…``, ``dictionary.json``, ``categories.json``,
``version.json``); reading them is the caller's business.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proofplane.errors import ValidationFailed

ERROR = "error"
WARNING = "warning"

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
_SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:-dev|-rc\.\d+)?$")


class SchemaError(ValidationFailed):
    """The schema files are incomplete or inconsistent (not the event's fault)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_ocsf_schema")


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem with an event: ``severity`` error or warning, a machine-readable ``code``
    (the OCSF server's names), the attribute ``path`` (``actor.user.name``, ``resources[0]``)."""

    severity: str
    code: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity} {self.code} at {self.path or '<event>'}: {self.message}"


@dataclass(frozen=True, slots=True)
class Attribute:
    name: str
    type: str  # a dictionary type (string_t, …) or "object_t"
    object_type: str | None
    is_array: bool
    requirement: str  # required | recommended | optional
    enum: Mapping[str, str] | None  # value (as a string) -> caption
    sibling: str | None
    profile: str | None


@dataclass(frozen=True, slots=True)
class Item:
    """A compiled class or object."""

    name: str
    caption: str
    uid: int | None  # classes only
    attributes: Mapping[str, Attribute]
    constraints: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Schema:
    version: str
    classes: Mapping[int, Item]
    objects: Mapping[str, Item]
    types: Mapping[str, Mapping[str, Any]]
    profiles: frozenset[str]

    def validate(self, event: Any, *, warn_recommended: bool = False) -> list[Finding]:
        """Everything wrong with one event (an empty list: it conforms)."""
        return _Validator(self, warn_recommended).event(event)


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == ERROR]


# --- compiling ---------------------------------------------------------------------------------


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class _Compiler:
    def __init__(self, files: Mapping[str, Any]) -> None:
        self.files = files
        try:
            dictionary = files["dictionary.json"]
            self.dict_attrs: Mapping[str, Any] = dictionary["attributes"]
            self.types: Mapping[str, Mapping[str, Any]] = dictionary["types"]["attributes"]
            self.categories = {
                name: (int(c["uid"]), str(c.get("caption", name)))
                for name, c in files["categories.json"]["attributes"].items()
            }
            self.version = str(files["version.json"]["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"not an OCSF schema: {exc!r}") from None
        self.raw_objects: dict[str, Mapping[str, Any]] = {}
        self.raw_classes: dict[str, Mapping[str, Any]] = {}
        self.profiles: set[str] = set()
        for path, doc in files.items():
            if not isinstance(doc, Mapping) or "name" not in doc:
                continue
            if path.startswith("objects/"):
                self.raw_objects[doc["name"]] = doc
            elif path.startswith("events/"):
                self.raw_classes[doc["name"]] = doc
            elif path.startswith("profiles/"):
                self.profiles.add(doc["name"])
        self.objects: dict[str, Item] = {}
        self._merged_objects: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def _included(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        """The attributes with their ``$include`` files merged under them."""
        out: dict[str, Any] = {}
        for path in attributes.get("$include", []):
            doc = self.files.get(path)
            if not isinstance(doc, Mapping):
                raise SchemaError(f"$include {path!r} is missing")
            included = self._included(doc.get("attributes", {}))
            if path.startswith("profiles/"):
                included = {
                    k: {**v, "profile": v.get("profile", doc["name"])} for k, v in included.items()
                }
            out = _deep_merge(out, included)
        own = {k: v for k, v in attributes.items() if k != "$include"}
        return _deep_merge(out, own)

    def _chain(
        self, raw: Mapping[str, Mapping[str, Any]], name: str, seen: tuple[str, ...] = ()
    ) -> tuple[dict[str, Any], dict[str, Any], list[Mapping[str, Any]]]:
        """(merged attributes, constraints, the docs from the root down) of ``name``."""
        if name in seen:
            raise SchemaError(f"'extends' loop through {name!r}")
        doc = raw.get(name)
        if doc is None:
            raise SchemaError(f"{name!r} is not defined")
        attrs = self._included(doc.get("attributes", {}))
        parent = doc.get("extends")
        if parent:
            p_attrs, p_cons, docs = self._chain(raw, parent, (*seen, name))
            attrs = _deep_merge(p_attrs, attrs)
            cons = dict(doc["constraints"]) if "constraints" in doc else p_cons
            return attrs, cons, [*docs, doc]
        return attrs, dict(doc.get("constraints", {})), [doc]

    def _attribute(self, name: str, spec: Mapping[str, Any], where: str) -> Attribute:
        base = self.dict_attrs.get(name)
        if base is None:
            raise SchemaError(f"{where}: attribute {name!r} is not in the dictionary")
        merged = _deep_merge(base, spec)
        typ = str(merged.get("type", ""))
        if typ in self.types:
            kind, object_type = typ, None
        elif typ in self.raw_objects:
            kind, object_type = "object_t", typ
        else:
            raise SchemaError(f"{where}.{name}: type {typ!r} is neither a type nor an object")
        enum = merged.get("enum")
        return Attribute(
            name=name,
            type=kind,
            object_type=object_type,
            is_array=bool(merged.get("is_array", False)),
            requirement=str(merged.get("requirement") or "optional"),
            enum=None
            if enum is None
            else {str(k): str(v.get("caption", k)) for k, v in enum.items()},
            sibling=merged.get("sibling"),
            profile=merged.get("profile"),
        )

    def object(self, name: str) -> Item:
        if name not in self.objects:
            attrs, cons, docs = self._chain(self.raw_objects, name)
            compiled = {k: self._attribute(k, v, name) for k, v in attrs.items()}
            caption = str(docs[-1].get("caption", name))
            self.objects[name] = Item(name, caption, None, compiled, _constraints(cons))
        return self.objects[name]

    def cls(self, name: str) -> Item | None:
        attrs, cons, docs = self._chain(self.raw_classes, name)
        doc = docs[-1]
        category = next((d["category"] for d in reversed(docs) if "category" in d), None)
        if name == "base_event":
            uid, cat_uid, cat_caption = 0, 0, "Uncategorized"
        elif "uid" in doc and category in self.categories:
            cat_uid, cat_caption = self.categories[category]
            uid = cat_uid * 1000 + int(doc["uid"])
        else:
            return None  # an abstract parent (iam, finding, …)
        caption = str(doc.get("caption", name))
        attrs = _deep_merge(
            attrs,
            {
                "class_uid": {"enum": {str(uid): {"caption": caption}}},
                "category_uid": {"enum": {str(cat_uid): {"caption": cat_caption}}},
            },
        )
        compiled = {k: self._attribute(k, v, name) for k, v in attrs.items()}
        activities = compiled["activity_id"].enum or {}
        type_uid = compiled["type_uid"]
        type_enum = {str(uid * 100 + int(a)): f"{caption}: {c}" for a, c in activities.items()}
        compiled["type_uid"] = Attribute(
            type_uid.name, type_uid.type, None, False, type_uid.requirement, type_enum,
            type_uid.sibling, None,
        )  # fmt: skip
        return Item(name, caption, uid, compiled, _constraints(cons))


def _constraints(raw: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    return {str(k): tuple(str(x) for x in v) for k, v in raw.items()}


def compile_schema(files: Mapping[str, Any]) -> Schema:
    """The schema these files define (``{path relative to the schema root: parsed JSON}``)."""
    c = _Compiler(files)
    classes: dict[int, Item] = {}
    for name in sorted(c.raw_classes):
        item = c.cls(name)
        if item is not None and item.uid is not None:
            classes[item.uid] = item
    for name in sorted(c.raw_objects):
        c.object(name)
    return Schema(c.version, classes, dict(c.objects), c.types, frozenset(c.profiles))


# --- validating --------------------------------------------------------------------------------


def _path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


@dataclass
class _Validator:
    schema: Schema
    warn_recommended: bool
    out: list[Finding] = field(default_factory=list)
    profiles: frozenset[str] = frozenset()

    def add(self, severity: str, code: str, path: str, message: str) -> None:
        self.out.append(Finding(severity, code, path, message))

    def event(self, event: Any) -> list[Finding]:
        if not isinstance(event, Mapping):
            self.add(ERROR, "event_not_object", "", f"an event is an object, not {_kind(event)}")
            return self.out
        class_uid = event.get("class_uid")
        if class_uid is None:
            self.add(ERROR, "attribute_required_missing", "class_uid", "class_uid is required")
            return self.out
        if not _is_int(class_uid, INT32):
            self.add(ERROR, "attribute_wrong_type", "class_uid", "class_uid is an integer_t")
            return self.out
        cls = self.schema.classes.get(class_uid)
        if cls is None:
            self.add(ERROR, "class_uid_unknown", "class_uid", f"no class has uid {class_uid}")
            return self.out
        self.profiles = self._profiles(event)
        self.attributes(event, "", cls)
        self.constraints(event, "", cls)
        self.type_uid(event)
        self.version(event)
        return self.out

    def _profiles(self, event: Mapping[str, Any]) -> frozenset[str]:
        metadata = event.get("metadata")
        profiles = metadata.get("profiles") if isinstance(metadata, Mapping) else None
        if not isinstance(profiles, list):
            return frozenset()
        for i, name in enumerate(profiles):
            if isinstance(name, str) and name not in self.schema.profiles:
                self.add(ERROR, "profile_unknown", f"metadata.profiles[{i}]",
                         f"no profile is named {name!r}")  # fmt: skip
        return frozenset(p for p in profiles if isinstance(p, str))

    def attributes(self, obj: Mapping[str, Any], parent: str, item: Item) -> None:
        allowed = {
            k: a
            for k, a in item.attributes.items()
            if a.profile is None or a.profile in self.profiles
        }
        for name, attr in allowed.items():
            path = _path(parent, name)
            value = obj.get(name)
            if value is None:
                if attr.requirement == "required":
                    self.add(ERROR, "attribute_required_missing", path,
                             f"{name!r} is required in {item.name}")  # fmt: skip
                elif attr.requirement == "recommended" and self.warn_recommended:
                    self.add(WARNING, "attribute_recommended_missing", path,
                             f"{name!r} is recommended in {item.name}")  # fmt: skip
                continue
            if attr.is_array:
                if not isinstance(value, list):
                    self.add(ERROR, "attribute_wrong_type", path,
                             f"expected an array of {attr.object_type or attr.type}, got "
                             f"{_kind(value)}")  # fmt: skip
                    continue
                for i, element in enumerate(value):
                    self.value(element, f"{path}[{i}]", attr)
            else:
                self.value(value, path, attr)
            if attr.enum is not None:
                self.enum(obj, parent, attr)
        if not item.attributes:
            return  # an open object (type "object", it defines nothing): anything goes
        # (an object whose attributes all need an undeclared profile is closed, not open)
        for key in obj:
            if key not in allowed:
                why = (
                    f"it belongs to the {item.attributes[key].profile!r} profile, which "
                    "metadata.profiles does not declare"
                    if key in item.attributes
                    else f"{item.name} does not define it"
                )
                self.add(ERROR, "attribute_unknown", _path(parent, str(key)),
                         f"unknown attribute {key!r}: {why}")  # fmt: skip

    def enum(self, obj: Mapping[str, Any], parent: str, attr: Attribute) -> None:
        assert attr.enum is not None
        values = obj[attr.name] if attr.is_array else [obj[attr.name]]
        if not isinstance(values, list):
            return  # reported as a wrong type
        for value in values:
            key = _enum_key(value)
            path = _path(parent, attr.name)
            if key not in attr.enum:
                self.add(ERROR, "attribute_enum_value_unknown", path,
                         f"{value!r} is not a value of {attr.name}")  # fmt: skip
                continue
            if attr.is_array or not attr.sibling or attr.sibling not in obj:
                continue
            caption, sibling = attr.enum[key], obj[attr.sibling]
            if key == "99" and sibling == caption:
                self.add(WARNING, "attribute_enum_sibling_suspicious_other",
                         _path(parent, attr.sibling),
                         f"{attr.sibling} is {sibling!r} for {attr.name} 99: name the source's "
                         "own value instead")  # fmt: skip
            elif key != "99" and sibling != caption:
                self.add(WARNING, "attribute_enum_sibling_incorrect",
                         _path(parent, attr.sibling),
                         f"{attr.sibling} is {sibling!r}; {attr.name} {value} is "
                         f"{caption!r}")  # fmt: skip

    def value(self, value: Any, path: str, attr: Attribute) -> None:
        if attr.type == "object_t":
            if not isinstance(value, Mapping):
                self.add(ERROR, "attribute_wrong_type", path,
                         f"expected a {attr.object_type} object, got {_kind(value)}")  # fmt: skip
                return
            assert attr.object_type is not None
            item = self.schema.objects[attr.object_type]
            self.attributes(value, path, item)
            self.constraints(value, path, item)
            return
        self.primitive(value, path, attr.type)

    def primitive(self, value: Any, path: str, type_name: str) -> None:
        spec = self.schema.types[type_name]
        base = str(spec.get("type", type_name))
        base_spec = self.schema.types.get(base, {})
        if base not in _PRIMITIVES:
            raise SchemaError(f"{path}: type {type_name!r} has no primitive type")
        if not _PRIMITIVES[base](value):
            shown = type_name if base == type_name else f"{type_name} ({base})"
            self.add(ERROR, "attribute_wrong_type", path,
                     f"expected {shown}, got {_kind(value)}")  # fmt: skip
            return
        for rules in (spec, base_spec):
            if "values" in rules and value not in rules["values"]:
                self.add(ERROR, "attribute_value_not_in_type_values", path,
                         f"{value!r} is not one of {type_name}'s values")  # fmt: skip
            if "range" in rules:
                low, high = rules["range"]
                if not low <= value <= high:
                    self.add(ERROR, "attribute_value_exceeds_range", path,
                             f"{value} is outside {type_name}'s range [{low}, {high}]")  # fmt: skip
        if isinstance(value, str):
            max_len = spec.get("max_len", base_spec.get("max_len"))
            if max_len is not None and len(value) > int(max_len):
                self.add(ERROR, "attribute_value_exceeds_max_len", path,
                         f"{len(value)} characters; {type_name} allows {max_len}")  # fmt: skip
            regex = spec.get("regex")
            if regex is not None and re.search(regex, value) is None:
                self.add(ERROR, "attribute_value_regex_not_matched", path,
                         f"{value[:80]!r} is not a valid {type_name}")  # fmt: skip

    def constraints(self, obj: Mapping[str, Any], path: str, item: Item) -> None:
        for kind, names in item.constraints.items():
            present = [n for n in names if n in obj]
            where = f"{item.name}: {kind} of {', '.join(names)}"
            if kind == "at_least_one" and not present:
                self.add(ERROR, "constraint_failed", path, f"{where}: none present")
            elif kind == "just_one" and len(present) != 1:
                self.add(ERROR, "constraint_failed", path, f"{where}: {len(present)} present")
            elif kind not in ("at_least_one", "just_one"):
                raise SchemaError(f"{item.name}: unknown constraint {kind!r}")

    def type_uid(self, event: Mapping[str, Any]) -> None:
        c, a, t = event.get("class_uid"), event.get("activity_id"), event.get("type_uid")
        if not all(_is_int(x, INT64) for x in (c, a, t)):
            return  # missing or mistyped: reported with the attributes
        assert isinstance(c, int) and isinstance(a, int)
        if t != c * 100 + a:
            self.add(ERROR, "type_uid_incorrect", "type_uid",
                     f"{t} is not class_uid * 100 + activity_id = {c * 100 + a}")  # fmt: skip

    def version(self, event: Mapping[str, Any]) -> None:
        metadata = event.get("metadata")
        version = metadata.get("version") if isinstance(metadata, Mapping) else None
        if not isinstance(version, str):
            return
        if not _SEMVER.match(version):
            self.add(ERROR, "version_invalid_format", "metadata.version",
                     f"{version!r} is not a semantic version")  # fmt: skip
        elif _semver_key(version) > _semver_key(self.schema.version):
            self.add(ERROR, "version_incompatible", "metadata.version",
                     f"{version} is newer than the schema ({self.schema.version})")  # fmt: skip
        elif version != self.schema.version:
            self.add(WARNING, "version_incorrect", "metadata.version",
                     f"{version} is validated against schema {self.schema.version}")  # fmt: skip


def _is_int(value: Any, bounds: tuple[int, int]) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and bounds[0] <= value <= bounds[1]
    )


_PRIMITIVES: dict[str, Callable[[Any], bool]] = {
    "boolean_t": lambda v: isinstance(v, bool),
    "integer_t": lambda v: _is_int(v, INT32),
    "long_t": lambda v: _is_int(v, INT64),
    "float_t": lambda v: isinstance(v, float),
    "string_t": lambda v: isinstance(v, str),
    "json_t": lambda v: True,
}


def _enum_key(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _semver_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("-", 1)[0].split("."))
