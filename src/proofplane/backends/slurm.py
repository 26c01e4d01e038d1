"""The Slurm backend: proofplane's placement becomes an ``sbatch`` that Slurm must honour.

The mapping (every piece a pure function below, so it can be checked without a Slurm):

* certifications → node ``Features``; a workload's compliance tags → ``--constraint`` (AND of
  features). ``hipaa=true`` is the feature ``hipaa``; any other pair ``key=value`` is
  ``key@value``. ``@`` appears in neither keys nor values, so the encoding is injective: no
  two different tags can ever meet in the same feature.
* GPUs → GRES types: a whole GPU of model ``H100-80GB`` is ``gpu:h100``; a MIG instance is its
  profile, ``gpu:3g.40gb``.
* a placement → ``sbatch --nodelist=<node> --gres=gpu:<type>:<n> --constraint=<features>``;
  the constraint repeats the compliance check inside Slurm, so a node whose features were
  changed behind proofplane's back refuses the job instead of running it.
* quarantine → ``scontrol update NodeName=… State=DRAIN Reason=…``; release → ``RESUME``.
* a node Slurm reports ``DOWN`` (or ``NOT_RESPONDING``) → ``node_lost``.

Slurm chooses GPU *indices* itself (lowest free first); ``--gres`` cannot name them. So
``sync`` reads the indices Slurm allocated (``squeue --json``) and reports them; the service
layer compares them with proofplane's placement and records any divergence.

Slurm is driven through its commands (``SLURM_CONF`` selects the cluster): pyslurm has no
release for Slurm 22.05 and slurmrestd cannot drain nodes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proofplane.backends.base import (
    BackendUnavailable,
    Change,
    ChangeKind,
    DrainFailed,
    JobRejected,
    JobSpec,
)
from proofplane.model import Gpu, Node, PlacedDevice, Placement

Runner = Callable[[Sequence[str], Mapping[str, str], float], subprocess.CompletedProcess[str]]

# Slurm's own words for "cannot reach the controller" (as opposed to "refused your request").
_UNREACHABLE = (
    "unable to contact slurm controller",
    "connection refused",
    "socket timed out",
    "communication connection failure",
    "zero bytes were transmitted",
    "unable to establish",
    "munge",
)


# --- pure mapping ----------------------------------------------------------------------------


def slurm_feature(key: str, value: str) -> str:
    """The Slurm node feature for a certification / compliance tag (injective, see above)."""
    return key if value == "true" else f"{key}@{value}"


def slurm_features(tags: Mapping[str, str]) -> list[str]:
    return [slurm_feature(k, v) for k, v in sorted(tags.items())]


def gres_type_of_model(model: str) -> str:
    """``H100-80GB`` → ``h100``: the GPU family, the way Slurm sites name GRES types."""
    return model.split("-", 1)[0].lower()


def gres_type(device: PlacedDevice, model: str | None) -> str | None:
    """The GRES type a placed device is requested as; None: untyped ``gpu``."""
    if device.mig_profile is not None:
        return device.mig_profile
    return gres_type_of_model(model) if model else None


def gres_request(devices: Sequence[PlacedDevice], models: Mapping[str, str]) -> str:
    """``--gres`` for one node's devices: ``gpu:h100:2`` or ``gpu:3g.40gb:1,gpu:1g.10gb:2``."""
    if any(d.share_milli is not None for d in devices):
        raise JobRejected(
            "the Slurm backend cannot run a shared-GPU (share_milli) workload: Slurm allocates "
            "whole GPUs or MIG instances; ask for a MIG profile or a whole GPU"
        )
    counts: dict[str | None, int] = {}
    for d in devices:
        t = gres_type(d, models.get(d.gpu_uuid))
        counts[t] = counts.get(t, 0) + 1
    return ",".join(
        f"gpu:{t}:{n}" if t else f"gpu:{n}" for t, n in sorted(counts.items(), key=lambda x: str(x))
    )


def job_name(job: JobSpec) -> str:
    return f"pp.{job.tenant}.{job.workload}"


def sbatch_args(
    job: JobSpec,
    *,
    output_dir: str,
    models: Mapping[str, str] | None = None,
    partition: str | None = None,
) -> list[str]:
    """The ``sbatch`` command line for a placed workload. Pure.

    ``models`` maps GPU UUID → model (from proofplane's inventory) for the GRES type. A gang
    placement becomes one job over all its nodes with the same GRES on each."""
    if not job.command:
        raise JobRejected(f"workload {job.key} has no command to run")
    models = models or job.gpu_models
    parts = job.placement.parts
    gres = {gres_request(p.devices, models) for p in parts}
    if len(gres) != 1:
        raise JobRejected(
            "a gang whose nodes hold different GPU shapes cannot be one Slurm job",
            details={"gres": sorted(gres)},
        )
    args = [
        "sbatch",
        "--parsable",
        f"--job-name={job_name(job)}",
        f"--comment=proofplane:{job.key}",
        f"--nodelist={','.join(p.node for p in parts)}",
        f"--nodes={len(parts)}",
        "--ntasks-per-node=1",
        f"--gres={gres.pop()}",
        f"--output={output_dir}/%j.out",
        f"--error={output_dir}/%j.err",
        "--export=NONE",
    ]
    features = slurm_features(job.tags)
    if features:
        args.append(f"--constraint={'&'.join(features)}")
    if partition:
        args.append(f"--partition={partition}")
    indices = ";".join(f"{p.node}:{','.join(str(d.gpu_index) for d in p.devices)}" for p in parts)
    args.append(f"--wrap={_wrap(job, indices)}")
    return args


def _wrap(job: JobSpec, indices: str) -> str:
    exports = {
        "PROOFPLANE_WORKLOAD": job.workload,
        "PROOFPLANE_TENANT": job.tenant,
        "PROOFPLANE_PLACEMENT": indices,
    }
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items())
    return f"export {env}; exec {shlex.join(job.command)}"


def _gres_for_gpus(gpus: Sequence[Gpu]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in gpus:
        if g.mig_enabled:
            for inst in g.mig_instances:
                counts[inst.profile] = counts.get(inst.profile, 0) + 1
        else:
            t = gres_type_of_model(g.model)
            counts[t] = counts.get(t, 0) + 1
    return counts


def slurm_node_line(node: Node, *, cpus: int = 64, memory_mb: int = 1_000_000) -> str:
    """A ``slurm.conf`` ``NodeName=`` line for a proofplane node. Pure.

    Only certifications become features: labels are self-declared and must never be able to
    satisfy a compliance constraint."""
    parts = [f"NodeName={node.name}", f"CPUs={cpus}", f"RealMemory={memory_mb}"]
    features = slurm_features(node.certifications)
    if features:
        parts.append(f"Features={','.join(features)}")
    gres = _gres_for_gpus(node.gpus)
    if gres:
        parts.append("Gres=" + ",".join(f"gpu:{t}:{n}" for t, n in sorted(gres.items())))
    return " ".join(parts)


def gres_slots(node: Node) -> list[tuple[str, str, int | None]]:
    """Every GRES unit of a node as (type, GPU UUID, MIG start slot or None), in the order
    Slurm numbers them: by type (the order of the node's ``Gres=`` list), then GPU index and
    slot. ``gres_conf_lines`` writes them in this order, so a unit's position here is its
    Slurm GPU index (``SLURM_JOB_GPUS``, ``IDX:`` in ``squeue``). Pure."""
    slots: list[tuple[str, int, int, str, int | None]] = []
    for g in node.gpus:
        if g.mig_enabled:
            for inst in g.mig_instances:
                slots.append((inst.profile, g.index, inst.start, g.uuid, inst.start))
        else:
            slots.append((gres_type_of_model(g.model), g.index, -1, g.uuid, None))
    return [(t, uuid, start) for t, _i, _s, uuid, start in sorted(slots)]


def gres_conf_lines(node: Node, device_file: Callable[[Node, int], str] | None = None) -> list[str]:
    """``gres.conf`` lines for a proofplane node, one per GRES unit in ``gres_slots`` order.
    Pure.

    ``File=`` is ``/dev/nvidia<GPU index>`` for whole GPUs unless ``device_file(node, k)``
    (k: the unit's position) says otherwise. On real MIG hardware use ``AutoDetect=nvml``,
    which knows the MIG device files; ``device_file`` lets a test cluster give every MIG
    instance its own fake device."""
    lines: list[str] = []
    index_of = {g.uuid: g.index for g in node.gpus}
    for k, (gtype, uuid, _start) in enumerate(gres_slots(node)):
        path = device_file(node, k) if device_file else f"/dev/nvidia{index_of[uuid]}"
        lines.append(f"NodeName={node.name} Name=gpu Type={gtype} File={path}")
    return lines


def slurm_indices(placement: Placement, node: Node) -> tuple[int, ...]:
    """The Slurm GPU indices that a placement's devices on ``node`` are. Pure."""
    position = {(uuid, start): k for k, (_t, uuid, start) in enumerate(gres_slots(node))}
    part = next(p for p in placement.parts if p.node == node.name)
    return tuple(sorted(position[(d.gpu_uuid, d.mig_start)] for d in part.devices))


_IDX = re.compile(r"IDX:([0-9,\-]+)")


def parse_gres_indices(details: Iterable[str]) -> tuple[int, ...]:
    """``["gpu:h100:2(IDX:0-1,3)"]`` → ``(0, 1, 3)``. Pure."""
    out: set[int] = set()
    for text in details:
        for m in _IDX.finditer(text):
            for chunk in m.group(1).split(","):
                lo, _, hi = chunk.partition("-")
                if lo:
                    out.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(out))


_SUCCEEDED = {"COMPLETED"}
_CANCELLED = {"CANCELLED"}
_RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def _state_of(job: Mapping[str, Any]) -> str:
    state = job.get("job_state", "")
    if isinstance(state, list):  # newer Slurm: a list of flags
        state = state[0] if state else ""
    return str(state).upper()


def changes_from_squeue(doc: Mapping[str, Any], job_ids: Collection[str]) -> dict[str, Change]:
    """The state of ``job_ids`` as ``squeue --json`` shows it. Jobs it does not list are
    absent from the result (the caller decides what an unknown job means). Pure."""
    out: dict[str, Change] = {}
    wanted = set(job_ids)
    for job in doc.get("jobs", ()):
        job_id = str(job.get("job_id"))
        if job_id not in wanted:
            continue
        state = _state_of(job)
        nodes = str(job.get("nodes") or "")
        # Slurm lists the allocated indices only while the job holds them.
        indices = parse_gres_indices(job.get("gres_detail") or ())
        devices = {nodes: indices} if nodes and indices else None
        reason = str(job.get("state_reason") or "")
        exit_code = job.get("exit_code")
        if isinstance(exit_code, dict):  # newer Slurm: {"status": ..., "return_code": ...}
            exit_code = exit_code.get("return_code")
        if state in _RUNNING:
            msg = f"{state.lower()} on {nodes}" if nodes else f"{state.lower()} ({reason})"
            kind = ChangeKind.RUNNING
            if state == "PENDING":
                # Slurm holds the job: proofplane's placement promised capacity that Slurm does
                # not see free (e.g. a drained node). Report it, still as not-yet-finished.
                msg = f"pending in Slurm: {reason}"
            out[job_id] = Change(kind, job_id, message=msg, devices=devices)
        elif state in _SUCCEEDED:
            out[job_id] = Change(
                ChangeKind.SUCCEEDED, job_id, message="completed", exit_code=0, devices=devices
            )
        elif state in _CANCELLED:
            out[job_id] = Change(ChangeKind.CANCELLED, job_id, message="cancelled in Slurm")
        else:
            detail = f" ({reason})" if reason and reason != "None" else ""
            out[job_id] = Change(
                ChangeKind.FAILED,
                job_id,
                message=f"Slurm job {state.lower()}{detail}",
                exit_code=int(exit_code) if isinstance(exit_code, int) else None,
                devices=devices,
            )
    return out


def lost_nodes_from_sinfo(doc: Mapping[str, Any]) -> list[Change]:
    """``node_lost`` for every node ``sinfo --json`` reports DOWN or FAIL. Pure."""
    out = []
    for node in doc.get("nodes", ()):
        state = node.get("state", "")
        flags = node.get("state_flags") or []
        if isinstance(state, list):
            flags, state = [*state[1:], *flags], (state[0] if state else "")
        words = {str(state).upper(), *(str(f).upper() for f in flags)}
        # NOT_RESPONDING alone is transient (a resumed node until its next ping); Slurm turns
        # it into DOWN after SlurmdTimeout. Only DOWN / FAIL evict work.
        if words & {"DOWN", "FAIL"}:
            reason = node.get("reason") or "no reason given"
            out.append(
                Change(
                    ChangeKind.NODE_LOST,
                    node=str(node.get("name")),
                    message=f"Slurm reports the node {str(state).lower()}: {reason}",
                )
            )
    return out


# --- the command-driven backend --------------------------------------------------------------


def _run(
    args: Sequence[str], env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), env=dict(env), capture_output=True, text=True, timeout=timeout, check=False
    )


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    conf: str | None = None  # SLURM_CONF; None: Slurm's default (/etc/slurm/slurm.conf)
    bin_dir: str | None = None  # where sbatch & co. live; None: $PATH
    partition: str | None = None
    output_dir: str = "/tmp"  # where jobs' stdout/stderr go (%j.out, %j.err), on the nodes
    timeout_s: float = 15.0


class SlurmBackend:
    name = "slurm"

    def __init__(
        self,
        options: SlurmOptions | None = None,
        *,
        models: Callable[[JobSpec], Mapping[str, str]] | None = None,
        runner: Runner = _run,
    ) -> None:
        self.options = options or SlurmOptions()
        self._models = models
        self._runner = runner

    def _exe(self, name: str) -> str:
        if self.options.bin_dir:
            path = str(Path(self.options.bin_dir) / name)
            found = path if os.access(path, os.X_OK) else None
        else:
            found = shutil.which(name)
        if found is None:
            where = self.options.bin_dir or "$PATH"
            raise BackendUnavailable(f"Slurm command {name!r} not found in {where}")
        return found

    def _call(self, args: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ}
        if self.options.conf:
            env["SLURM_CONF"] = self.options.conf
        cmd = [self._exe(args[0]), *args[1:]]
        try:
            result = self._runner(cmd, env, self.options.timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise BackendUnavailable(
                f"{what}: Slurm did not answer within {self.options.timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise BackendUnavailable(f"{what}: cannot run {args[0]}: {exc}") from exc
        if result.returncode != 0:
            message = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
            if any(s in message.lower() for s in _UNREACHABLE):
                raise BackendUnavailable(f"{what}: {message}", details={"command": args[0]})
            result.stderr = message
        return result

    def submit(self, job: JobSpec) -> str:
        models = self._models(job) if self._models else {}
        args = sbatch_args(
            job,
            output_dir=self.options.output_dir,
            models=models,
            partition=self.options.partition,
        )
        result = self._call(args, f"sbatch {job.key}")
        if result.returncode != 0:
            raise JobRejected(
                f"Slurm rejected {job.key}: {result.stderr}",
                details={"workload": job.workload, "tenant": job.tenant},
            )
        job_id = result.stdout.strip().split(";", 1)[0]
        if not job_id.isdigit():
            raise BackendUnavailable(f"sbatch answered {result.stdout.strip()!r}, not a job id")
        return job_id

    def cancel(self, job_id: str) -> None:
        if not job_id.isdigit():
            return
        result = self._call(["scancel", job_id], f"scancel {job_id}")
        if result.returncode != 0 and "invalid job id" not in result.stderr.lower():
            raise JobRejected(f"Slurm did not cancel job {job_id}: {result.stderr}")

    def sync(self, job_ids: Collection[str]) -> list[Change]:
        known = changes_from_squeue(self._json(["squeue", "--json", "--all"]), job_ids)
        out: list[Change] = []
        for job_id in job_ids:
            out.append(
                known.get(job_id)
                or Change(
                    ChangeKind.FAILED,
                    job_id,
                    message="Slurm no longer knows the job (finished longer than MinJobAge ago "
                    "without accounting, or the controller lost its state)",
                )
            )
        out.extend(lost_nodes_from_sinfo(self._json(["sinfo", "--json"])))
        return out

    def _json(self, args: Sequence[str]) -> dict[str, Any]:
        """Run a ``--json`` query. Slurm 22.05 answers an unreachable controller with exit
        status 0 and an ``errors`` list next to an empty result: taking that result at face
        value would report every job gone, so any error is ``BackendUnavailable``."""
        result = self._call(args, args[0])
        if result.returncode != 0:
            raise BackendUnavailable(f"{args[0]} failed: {result.stderr}")
        try:
            doc = json.loads(result.stdout)
        except ValueError as exc:
            raise BackendUnavailable(f"{args[0]} did not answer JSON: {exc}") from exc
        errors = doc.get("errors") or []
        if errors:
            text = "; ".join(str(e.get("description") or e.get("error") or e) for e in errors)
            raise BackendUnavailable(f"{args[0]}: {text}", details={"errors": errors})
        return doc  # type: ignore[no-any-return]

    def _update(self, node: str, state: str, reason: str | None) -> None:
        args = ["scontrol", "update", f"NodeName={node}", f"State={state}"]
        if reason is not None:
            args.append(f"Reason={reason.replace(chr(10), ' ') or 'proofplane'}")
        result = self._call(args, f"scontrol update {node} {state}")
        if result.returncode != 0:
            raise DrainFailed(
                f"Slurm did not {state.lower()} node {node}: {result.stderr}",
                details={"node": node, "state": state},
            )

    def drain(self, node: str, reason: str) -> None:
        self._update(node, "DRAIN", f"proofplane: {reason}")

    def resume(self, node: str) -> None:
        self._update(node, "RESUME", None)

    def node_states(self) -> dict[str, dict[str, Any]]:
        """Each node's Slurm state words, reason and features (for checks and the CLI)."""
        out = {}
        for node in self._json(["sinfo", "--json"]).get("nodes", ()):
            state = node.get("state", "")
            flags = node.get("state_flags") or []
            if isinstance(state, list):
                flags, state = [*state[1:], *flags], (state[0] if state else "")
            out[str(node["name"])] = {
                "state": str(state).lower(),
                "flags": sorted(str(f).lower() for f in flags),
                "reason": node.get("reason") or "",
                "features": node.get("features") or node.get("active_features") or "",
            }
        return out

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "name": self.name,
            "conf": self.options.conf,
            "partition": self.options.partition,
        }
        try:
            nodes = self.node_states()
        except BackendUnavailable as exc:
            info.update(healthy=False, error=exc.message)
        else:
            info.update(healthy=True, nodes=len(nodes))
        return info
