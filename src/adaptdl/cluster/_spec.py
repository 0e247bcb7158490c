"""Job specifications: the ``AdaptDLJob`` manifest, parsed and validated.

The local cluster reads the same manifest that a Kubernetes cluster would
(``apiVersion: adaptdl.petuum.com/v1``, ``kind: AdaptDLJob``), so one file can
be submitted to either. Only the fields that make sense on one machine are
interpreted: ``spec.minReplicas``, ``maxReplicas``, ``preemptible``,
``maxRestarts`` and the one container's ``command``, ``args``, ``env`` and
``workingDir``. The other Kubernetes fields of the object, pod and container
(image, resources, volumes, scheduling constraints...) are accepted and
ignored, since they mean nothing on one machine. Everything else is rejected
rather than ignored: a field that exists nowhere (a typo such as
``maxReplica`` would otherwise silently leave the default in force), a second
container or init containers (which the backend cannot run), ``env``
entries with ``valueFrom`` and the container's ``envFrom`` (secrets, config
maps, pod fields exist only on Kubernetes), and unquoted ``args``, ``command``
or ``env`` values that YAML reads as numbers, booleans or dates (``0012``
would become ``10``; Kubernetes rejects them too). Every problem is reported
with the file, the path of the offending field and its value, so a user can
fix the file without reading this code.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from adaptdl.sched import MAX_COUNT

__all__ = [
    "API_VERSION",
    "KIND",
    "JobSpec",
    "JobSpecError",
    "load_job_file",
    "parse_job_manifest",
    "validate_job_name",
]

API_VERSION = "adaptdl.petuum.com/v1"
KIND = "AdaptDLJob"

#: Kubernetes label values (and so job names) are DNS-1123 labels of <= 63 chars.
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Restarts after failures before a job is marked Failed, unless the spec says.
DEFAULT_MAX_RESTARTS = 3

#: Kubernetes ``ObjectMeta`` fields: only ``name`` and ``generateName`` are used.
_METADATA_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "labels",
        "annotations",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "ownerReferences",
        "finalizers",
        "managedFields",
        "selfLink",
    }
)
#: Top-level fields of an AdaptDLJob (``status`` appears in exported objects).
_OBJECT_FIELDS = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})
#: The AdaptDLJob ``spec``: every field is interpreted.
_JOB_SPEC_FIELDS = frozenset(
    {"minReplicas", "maxReplicas", "preemptible", "maxRestarts", "template"}
)
#: The pod template.
_TEMPLATE_FIELDS = frozenset({"metadata", "spec"})
#: Kubernetes ``PodSpec`` fields. Besides ``containers``, these place, secure
#: or mount a pod on a cluster and mean nothing on one machine; they are
#: ignored. ``initContainers`` and ``ephemeralContainers`` are listed so
#: that they are refused with a reason rather than as unknown.
_POD_FIELDS = frozenset(
    {
        "containers",
        "initContainers",
        "ephemeralContainers",
        "activeDeadlineSeconds",
        "affinity",
        "automountServiceAccountToken",
        "dnsConfig",
        "dnsPolicy",
        "enableServiceLinks",
        "hostAliases",
        "hostIPC",
        "hostNetwork",
        "hostPID",
        "hostUsers",
        "hostname",
        "imagePullSecrets",
        "nodeName",
        "nodeSelector",
        "os",
        "overhead",
        "preemptionPolicy",
        "priority",
        "priorityClassName",
        "readinessGates",
        "resourceClaims",
        "resources",
        "restartPolicy",
        "runtimeClassName",
        "schedulerName",
        "schedulingGates",
        "securityContext",
        "serviceAccount",
        "serviceAccountName",
        "setHostnameAsFQDN",
        "shareProcessNamespace",
        "subdomain",
        "terminationGracePeriodSeconds",
        "tolerations",
        "topologySpreadConstraints",
        "volumes",
    }
)
#: Kubernetes ``Container`` fields. ``command``, ``args``, ``env`` and
#: ``workingDir`` are interpreted, ``envFrom`` is refused with a reason; the
#: others (image, resources, probes...) are ignored.
_CONTAINER_FIELDS = frozenset(
    {
        "name",
        "image",
        "command",
        "args",
        "workingDir",
        "env",
        "envFrom",
        "ports",
        "resources",
        "resizePolicy",
        "restartPolicy",
        "volumeMounts",
        "volumeDevices",
        "livenessProbe",
        "readinessProbe",
        "startupProbe",
        "lifecycle",
        "terminationMessagePath",
        "terminationMessagePolicy",
        "imagePullPolicy",
        "securityContext",
        "stdin",
        "stdinOnce",
        "tty",
    }
)
#: Fields of one ``env`` entry (``valueFrom`` is refused with a reason).
_ENV_FIELDS = frozenset({"name", "value", "valueFrom"})


class JobSpecError(ValueError):
    """A job manifest or submit option is invalid; the message names the field."""


@dataclass(frozen=True)
class JobSpec:
    """What the cluster needs to run one elastic job.

    Attributes:
        name: Unique job name (a DNS-1123 label, <= 63 characters).
        command: Program and arguments of every replica; ``python``/``python3``
            as the first word means the interpreter that runs the cluster, so
            the job sees the same installed ``adaptdl``.
        args: Extra arguments appended to ``command`` (``submit -- ARGS``).
        env: Extra environment variables for every replica.
        working_dir: Directory the replicas start in (the submitted project);
            a relative path is made absolute against the current directory
            when the spec is made, since the daemon that starts the replicas
            runs elsewhere.
        min_replicas: Fewest replicas the job may run with (0: may be paused).
        max_replicas: Most replicas the job may ever get.
        preemptible: Whether a running job may be rescaled or paused.
        max_restarts: Failures tolerated before the job is marked Failed.
    """

    name: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = "."
    min_replicas: int = 0
    max_replicas: int = 2**31 - 1
    preemptible: bool = True
    max_restarts: int = DEFAULT_MAX_RESTARTS

    def __post_init__(self) -> None:
        validate_job_name(self.name)
        # Frozen: normalise through object.__setattr__ (lists become tuples).
        object.__setattr__(self, "command", _arg_tuple("command", self.command))
        object.__setattr__(self, "args", _arg_tuple("args", self.args))
        if not self.command:
            raise JobSpecError(f"job {self.name!r}: the command is empty")
        if not isinstance(self.env, Mapping):
            raise JobSpecError(f"env={self.env!r}: expected a mapping of names to strings")
        for key, value in self.env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise JobSpecError(f"env {key!r}={value!r}: names and values must be strings")
        object.__setattr__(self, "env", dict(self.env))
        if not isinstance(self.working_dir, str) or not self.working_dir:
            raise JobSpecError(f"working_dir={self.working_dir!r}: expected a non-empty string")
        if not os.path.isabs(self.working_dir):
            # Joined, not normalised: "link/.." must stay the link's parent.
            object.__setattr__(self, "working_dir", os.path.join(os.getcwd(), self.working_dir))
        if not isinstance(self.preemptible, bool):
            raise JobSpecError(f"spec.preemptible={self.preemptible!r}: expected true or false")
        _check_int("spec.minReplicas", self.min_replicas, minimum=0)
        _check_int("spec.maxReplicas", self.max_replicas, minimum=1)
        _check_int("spec.maxRestarts", self.max_restarts, minimum=0)
        if self.min_replicas > self.max_replicas:
            raise JobSpecError(
                f"spec.minReplicas={self.min_replicas} is greater than "
                f"spec.maxReplicas={self.max_replicas}"
            )
        for key in self.env:
            if not _ENV_NAME_RE.fullmatch(key):
                raise JobSpecError(
                    f"env name {key!r} is not a valid environment variable name (letters, "
                    "digits and '_', not starting with a digit)"
                )

    @property
    def argv(self) -> tuple[str, ...]:
        """The full command line of one replica."""
        return self.command + self.args

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form, the inverse of :meth:`from_json`."""
        return {
            "name": self.name,
            "command": list(self.command),
            "args": list(self.args),
            "env": dict(self.env),
            "workingDir": self.working_dir,
            "minReplicas": self.min_replicas,
            "maxReplicas": self.max_replicas,
            "preemptible": self.preemptible,
            "maxRestarts": self.max_restarts,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, stored: bool = False) -> JobSpec:
        """Rebuild a spec from :meth:`to_json` output (the API's wire format).

        Args:
            data: The JSON object.
            stored: ``data`` is a job the cluster stored itself, perhaps
                under an older version that checked less: counts beyond
                2**31 - 1 are capped and a boolean env value is taken as the
                text it was stored as, so that the job still loads (one that
                did not would stop every listing and scheduling round).

        Raises:
            JobSpecError: a field is missing or has the wrong type.
        """
        if not isinstance(data, Mapping):
            raise JobSpecError(f"job spec: expected an object, got {type(data).__name__}")
        unknown = sorted(str(key) for key in data if key not in _JSON_FIELDS)
        if unknown:
            raise JobSpecError(
                f"job spec: unknown field(s) {', '.join(unknown)}; valid fields: "
                f"{', '.join(_JSON_FIELDS)}"
            )

        def count(key: str, default: int) -> int:
            value = _int(key, data.get(key, default))
            return min(value, MAX_COUNT) if stored else value

        env = data.get("env", {})
        if stored and isinstance(env, Mapping):
            env = {
                key: str(value) if isinstance(value, bool) else value for key, value in env.items()
            }
        try:
            return cls(
                name=_str("name", data.get("name")),
                command=_str_list("command", data.get("command")),
                args=_str_list("args", data.get("args", [])),
                env=_env("env", env),
                working_dir=_str("workingDir", data.get("workingDir", ".")),
                min_replicas=count("minReplicas", 0),
                max_replicas=count("maxReplicas", MAX_COUNT),
                preemptible=_bool("preemptible", data.get("preemptible", True)),
                max_restarts=count("maxRestarts", DEFAULT_MAX_RESTARTS),
            )
        except TypeError as exc:  # pragma: no cover - dataclass signature mismatch
            raise JobSpecError(f"job spec: {exc}") from None


#: The fields of :meth:`JobSpec.to_json`, in its order: the dataclass
#: fields, camelCased.
_JSON_FIELDS = tuple(
    re.sub(r"_([a-z])", lambda match: match.group(1).upper(), spec_field.name)
    for spec_field in fields(JobSpec)
)


def check_launchable(spec: JobSpec) -> None:
    """Reject what no process can be started with: a NUL byte anywhere in the
    command line, the environment or the working directory.

    Checked when a job is submitted, not whenever a spec is read back, so a
    job stored by an older version still loads (and fails at launch).

    Raises:
        JobSpecError: naming the field and its value.
    """
    fields = [
        *((f"command[{i}]", item) for i, item in enumerate(spec.command)),
        *((f"args[{i}]", item) for i, item in enumerate(spec.args)),
        *((f"env {key}", value) for key, value in spec.env.items()),
        ("workingDir", spec.working_dir),
    ]
    for where, text in fields:
        if "\0" in text:
            raise JobSpecError(f"{where}={text!r}: contains a NUL byte")


def validate_job_name(name: str) -> str:
    """Check that ``name`` can name a job here and on Kubernetes.

    Raises:
        JobSpecError: the name is not a DNS-1123 label of at most 63 characters.
    """
    if not isinstance(name, str) or len(name) > 63 or not _NAME_RE.fullmatch(name):
        raise JobSpecError(
            f"job name {name!r} is invalid: use at most 63 lower-case letters, digits "
            "and '-', starting and ending with a letter or digit"
        )
    return name


#: Random characters appended to ``metadata.generateName``.
_GENERATED_SUFFIX = 6


def _generated_name(source: str, prefix: object) -> str:
    """A job name from ``metadata.generateName``, as Kubernetes makes one.

    A prefix too long for the 63-character limit is shortened to leave room
    for the random suffix, as the API server does, instead of being refused.
    """
    import secrets

    text = _str(f"{source}: metadata.generateName", prefix)
    name = text[: 63 - _GENERATED_SUFFIX] + secrets.token_hex(_GENERATED_SUFFIX // 2)
    if not _NAME_RE.fullmatch(name):
        raise JobSpecError(
            f"{source}: metadata.generateName={text!r} does not start a valid job name: "
            "use lower-case letters, digits and '-', starting with a letter or digit"
        )
    return name


def parse_job_manifest(
    doc: Any,
    *,
    source: str = "job file",
    name: str | None = None,
    working_dir: str = ".",
    args: Sequence[str] | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    written: Any = None,
) -> JobSpec:
    """Turn an ``AdaptDLJob`` manifest into a :class:`JobSpec`.

    Command-line options override the manifest, the way ``adaptdl submit``
    documents them. ``metadata.generateName`` gets a random suffix when no name
    is given.

    Args:
        doc: The parsed YAML document.
        source: Where the document came from (a file's path); every error
            message starts with it.
        name: Overrides ``metadata.name``.
        working_dir: Directory the replicas start in; the container's
            ``workingDir``, when given, is taken relative to it.
        args: Overrides ``containers[0].args`` when not None.
        min_replicas: Overrides ``spec.minReplicas``.
        max_replicas: Overrides ``spec.maxReplicas``.
        written: The same document with every scalar kept as the text the
            user wrote (``yaml.BaseLoader``), so that an unquoted ``0012``
            is quoted back as written rather than as the ``10`` YAML made of
            it; optional.

    Raises:
        JobSpecError: the manifest is malformed or asks for something the
            local backend cannot do; the message names the field.
    """
    if not isinstance(doc, Mapping):
        raise JobSpecError(f"{source}: expected a YAML mapping (an AdaptDLJob), got {doc!r}")
    _check_fields(source, "", doc, _OBJECT_FIELDS)
    api = doc.get("apiVersion", API_VERSION)
    if api != API_VERSION:
        raise JobSpecError(f"{source}: apiVersion={api!r}, expected {API_VERSION!r}")
    kind = doc.get("kind", KIND)
    if kind != KIND:
        raise JobSpecError(f"{source}: kind={kind!r}, expected {KIND!r}")
    metadata = _mapping(f"{source}: metadata", doc.get("metadata", {}))
    _check_fields(source, "metadata.", metadata, _METADATA_FIELDS)
    spec = _mapping(f"{source}: spec", doc.get("spec"))
    _check_fields(source, "spec.", spec, _JOB_SPEC_FIELDS)
    template = _mapping(f"{source}: spec.template", spec.get("template"))
    _check_fields(source, "spec.template.", template, _TEMPLATE_FIELDS)
    if "metadata" in template:
        template_metadata = _mapping(f"{source}: spec.template.metadata", template["metadata"])
        _check_fields(source, "spec.template.metadata.", template_metadata, _METADATA_FIELDS)
    pod_spec = _mapping(f"{source}: spec.template.spec", template.get("spec"))
    _check_fields(source, "spec.template.spec.", pod_spec, _POD_FIELDS)
    for extra in ("initContainers", "ephemeralContainers"):
        if pod_spec.get(extra):
            raise JobSpecError(
                f"{source}: spec.template.spec.{extra}: not supported by the local backend, "
                "which runs each replica's one container and nothing else; run those steps "
                "at the start of the container's command instead"
            )
    containers = pod_spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise JobSpecError(f"{source}: spec.template.spec.containers must be a non-empty list")
    if len(containers) > 1:
        names = [
            item.get("name", f"#{index}") if isinstance(item, Mapping) else f"#{index}"
            for index, item in enumerate(containers)
        ]
        raise JobSpecError(
            f"{source}: spec.template.spec.containers lists {len(containers)} containers "
            f"({', '.join(map(str, names))}): the local backend runs exactly one per replica; "
            "keep the training container and remove the others"
        )
    container = _mapping(f"{source}: spec.template.spec.containers[0]", containers[0])
    prefix = f"{source}: spec.template.spec.containers[0]"
    _check_fields(source, "spec.template.spec.containers[0].", container, _CONTAINER_FIELDS)
    if container.get("envFrom"):
        # Config maps and secrets exist only on Kubernetes.
        label = f" ({container['name']})" if isinstance(container.get("name"), str) else ""
        raise JobSpecError(
            f"{prefix}.envFrom{label}: envFrom is not supported by the local backend; list "
            "the variables under 'env' with literal values instead"
        )
    written_container = _lookup(written, "spec", "template", "spec", "containers", 0)
    command = _yaml_strings(
        f"{prefix}.command", container.get("command"), _lookup(written_container, "command")
    )
    if not command:
        raise JobSpecError(f"{prefix}.command is missing or empty")
    manifest_args = _yaml_strings(
        f"{prefix}.args", container.get("args", []) or [], _lookup(written_container, "args")
    )
    env: dict[str, str] = {}
    raw_env = container.get("env", []) or []
    if not isinstance(raw_env, list):
        raise JobSpecError(f"{prefix}.env={raw_env!r}: expected a list of {{name, value}}")
    for index, item in enumerate(raw_env):
        where = f"{prefix}.env[{index}]"
        entry = _mapping(where, item)
        _check_fields(source, f"spec.template.spec.containers[0].env[{index}].", entry, _ENV_FIELDS)
        key = _str(f"{where}.name", entry.get("name"))  # JobSpec checks the name itself
        if key in env:
            raise JobSpecError(f"{where}: variable {key!r} is set twice; keep one entry")
        if "valueFrom" in entry:
            # Secrets, config maps and pod fields exist only on Kubernetes.
            raise JobSpecError(
                f"{where} ({key}): valueFrom is not supported by the local backend; "
                "give a literal 'value' instead"
            )
        text = _lookup(written_container, "env", index, "value")
        value = entry.get("value")
        # "value:" with nothing after it is null, which Kubernetes reads as "".
        env[key] = "" if value is None else _yaml_string(f"{where}.value ({key})", value, text)
    if "workingDir" in container:
        # Relative to the submitted directory, which is where the project is
        # on this machine; an absolute path is used as it is.
        relative = _str(f"{prefix}.workingDir", container["workingDir"])
        working_dir = os.path.normpath(os.path.join(working_dir, relative))
        if not os.path.isdir(working_dir):
            state = "is a file" if os.path.exists(working_dir) else "does not exist on this machine"
            raise JobSpecError(
                f"{prefix}.workingDir={relative!r}: directory {working_dir} {state} "
                "(a relative workingDir starts from the submitted directory)"
            )
    if name is None:
        raw_name = metadata.get("name")
        if raw_name is None and metadata.get("generateName"):
            raw_name = _generated_name(source, metadata["generateName"])
        if raw_name is None:
            raise JobSpecError(f"{source}: metadata.name is missing (or pass --name)")
        name = _str(f"{source}: metadata.name", raw_name)
    min_r = min_replicas if min_replicas is not None else spec.get("minReplicas", 0)
    max_r = max_replicas if max_replicas is not None else spec.get("maxReplicas", 2**31 - 1)
    min_label = "--min-replicas" if min_replicas is not None else "spec.minReplicas"
    max_label = "--max-replicas" if max_replicas is not None else "spec.maxReplicas"
    min_r = _int(f"{source}: {min_label}", min_r)
    max_r = _int(f"{source}: {max_label}", max_r)
    if (min_replicas is not None or max_replicas is not None) and min_r > max_r:
        # Blame the value where the user wrote it: a flag is not in the file.
        raise JobSpecError(f"{source}: {min_label}={min_r} is greater than {max_label}={max_r}")
    fields: dict[str, Any] = {
        "min_replicas": min_r,
        "max_replicas": max_r,
        "preemptible": _bool(f"{source}: spec.preemptible", spec.get("preemptible", True)),
        "max_restarts": _int(
            f"{source}: spec.maxRestarts", spec.get("maxRestarts", DEFAULT_MAX_RESTARTS)
        ),
    }
    try:
        return JobSpec(
            name=name,
            command=command,
            args=tuple(args) if args is not None else manifest_args,
            env=env,
            working_dir=working_dir,
            **fields,
        )
    except JobSpecError as exc:  # a whole-spec check: say which file it is about
        raise JobSpecError(f"{source}: {exc}") from None


def load_job_file(path: str | Path, **overrides: Any) -> JobSpec:
    """Read and validate a YAML job file; see :func:`parse_job_manifest`.

    Every error message starts with ``path``, so a user knows which file to fix.

    Raises:
        JobSpecError: the file is missing, is a directory, is not UTF-8 YAML,
            or is not a valid AdaptDLJob.
    """
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml ships with the torch extra
        raise JobSpecError("reading job files needs PyYAML: pip install 'adaptdl[torch]'") from None
    file = Path(path)
    if file.is_dir():
        raise JobSpecError(
            f"{file}: is a directory, not a job file; pass the YAML file itself "
            f"(e.g. {file / 'adaptdljob.yaml'})"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobSpecError(f"{file}: cannot read job file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise JobSpecError(f"{file}: is not a UTF-8 text (YAML) file: {exc.reason}") from None
    # Composed once: the node tree is checked for duplicate keys, and the
    # document is built from it (what yaml.safe_load does in one step).
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        doc = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{file}: is not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    _refuse_duplicate_keys(str(file), node)
    try:
        written = yaml.load(text, Loader=yaml.BaseLoader)  # only str, list and dict
    except yaml.YAMLError:  # pragma: no cover - safe_load accepted the same text
        written = None
    return parse_job_manifest(doc, source=str(file), written=written, **overrides)


def _refuse_duplicate_keys(source: str, root: Any) -> None:
    """Refuse a mapping that names one key twice (YAML loaders keep the last).

    Keys are compared by tag and text (``1`` and ``"1"`` differ). Each node
    is visited once, so aliases (even one that contains itself) cost nothing
    more.

    Args:
        source: The file, for the message.
        root: The composed YAML document (``yaml.compose``).
    """
    import yaml

    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in keys:
                        raise JobSpecError(
                            f"{source}: line {line}: key {key.value!r} is given twice (first "
                            f"on line {keys[key.tag, key.value]}); keep one"
                        )
                    keys[key.tag, key.value] = line
                stack.extend((key, value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def _check_fields(source: str, where: str, value: Mapping[str, Any], known: frozenset[str]) -> None:
    """Reject a field of ``value`` that is not in ``known`` (a typo, most likely).

    Args:
        source: The file, for the message.
        where: The path of ``value`` in the document, ending with ``.``
            (empty at the top).
        value: The mapping whose keys are checked.
        known: The fields it may have.
    """
    for key in value:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise JobSpecError(
            f"{source}: {where}{key}: unknown field{hint}; valid fields: {', '.join(sorted(known))}"
        )


def _lookup(tree: Any, *path: str | int) -> Any:
    """The node at ``path`` in a loaded YAML tree, or None where there is none."""
    for step in path:
        if isinstance(step, int):
            if not isinstance(tree, list) or step >= len(tree):
                return None
            tree = tree[step]
        elif isinstance(tree, Mapping):
            tree = tree.get(step)
        else:
            return None
    return tree


def _yaml_string(what: str, value: Any, written: Any = None) -> str:
    """``value`` if it is a string; else a message that tells the user to quote it.

    YAML turns unquoted ``0012``, ``1.50``, ``on`` or ``2024-01-01`` into an
    integer, a float, a boolean or a date, and converting them back would not
    give what was written (``10``, ``1.5``, ``True``), so they are refused, as
    Kubernetes refuses them.

    Args:
        what: The field, for the message.
        value: What YAML made of it.
        written: The text as written in the file, when known.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (Mapping, list)):
        raise JobSpecError(f"{what}={value!r}: expected a string")
    text = written if isinstance(written, str) else None
    if value is None:
        read = "null"
        text = text or ""
    elif isinstance(value, bool):
        read = f"the boolean {str(value).lower()}"
    elif isinstance(value, int):
        read = f"the integer {value}"
    elif isinstance(value, float):
        read = f"the number {value!r}"
    elif isinstance(value, (datetime.date, datetime.datetime)):
        read = f"the date {value.isoformat()}"
    else:
        read = f"a {type(value).__name__}"
    if text is None:
        text = str(value).lower() if isinstance(value, bool) else str(value)
    also = "" if value is None else " (Kubernetes rejects it too)"
    raise JobSpecError(
        f"{what}={text or '(empty)'}: YAML reads this unquoted value as {read}, not a "
        f"string{also}; quote it: {json.dumps(text)}"
    )


def _yaml_strings(what: str, value: Any, written: Any = None) -> tuple[str, ...]:
    """A list of strings from the manifest; see :func:`_yaml_string`."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, list):
        raise JobSpecError(f"{what}={value!r}: expected a list of strings")
    texts = written if isinstance(written, list) and len(written) == len(value) else []
    return tuple(
        _yaml_string(f"{what}[{index}]", item, texts[index] if texts else None)
        for index, item in enumerate(value)
    )


def _check_int(what: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise JobSpecError(f"{what}={value!r}: expected an integer from {minimum} to 2**31 - 1")


def _arg_tuple(what: str, value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of strings; one string is refused, not split into letters."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise JobSpecError(
            f"{what}={value!r}: expected a sequence of strings, one per word "
            "(e.g. ('python', 'main.py')), not a single string"
        )
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise JobSpecError(f"{what}[{index}]={item!r}: expected a string")
    return tuple(value)


def _mapping(what: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise JobSpecError(f"{what} must be a mapping, got {value!r}")
    return value


def _str(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise JobSpecError(f"{what}={value!r}: expected a non-empty string")
    return value


def _str_list(what: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise JobSpecError(f"{what}={value!r}: expected a list of strings")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise JobSpecError(f"{what} contains {item!r}: expected strings")
        out.append(str(item))
    return tuple(out)


def _env(what: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise JobSpecError(f"{what}={value!r}: expected a mapping of strings")
    for key, item in value.items():
        # A number is written as it reads; null or a list has no one spelling.
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise JobSpecError(f"{what}.{key}={item!r}: expected a string")
    return {str(key): str(item) for key, item in value.items()}


def _int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobSpecError(f"{what}={value!r}: expected an integer")
    return value


def _bool(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise JobSpecError(f"{what}={value!r}: expected true or false")
    return value
