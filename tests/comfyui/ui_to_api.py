"""Convert a UI-format ComfyUI workflow (what the frontend saves, version 0.4) to an API prompt, without a
browser: the frontend's ``graphToPrompt`` in miniature.

Widget values are positional (``widgets_values``) in the order of the node's widget inputs; the schema
(``INPUT_TYPES()`` of the node classes, or ``/object_info``) says which inputs are widgets and in which
order. Two frontend-added values have no input of their own and are skipped:
* after an INT/COMBO with ``control_after_generate`` (and INT inputs named ``seed``/``noise_seed``): the
  control mode ("fixed", "randomize", ...);
* after a COMBO with ``image_upload``/``video_upload``/``audio_upload``: the upload button's value.
A widget input that was converted to a socket and linked still has its value in ``widgets_values``; the
link wins. Frontend-only nodes (Note, MarkdownNote, PrimitiveNode-free graphs only) and muted/bypassed nodes
(mode 2/4) are dropped. A count mismatch between widgets and values raises: that is exactly the bug
("widget order does not match the schema") this converter exists to catch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload", "animated_image_upload", "upload")


class WorkflowConversionError(ValueError):
    pass


def _spec(entry):
    """(type, options) of one INPUT_TYPES entry."""
    if isinstance(entry, (list, tuple)):
        typ = entry[0]
        opts = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
    else:
        typ, opts = entry, {}
    return typ, opts


def _is_widget(typ, opts) -> bool:
    if isinstance(typ, (list, tuple)):
        return True  # legacy combo
    return typ in WIDGET_TYPES and not opts.get("forceInput", False)


def schema_inputs(input_types: Mapping) -> list[tuple[str, object, dict]]:
    """[(name, type, options)] in schema order: required, then optional."""
    out = []
    for section in ("required", "optional"):
        for name, entry in (input_types.get(section) or {}).items():
            typ, opts = _spec(entry)
            out.append((name, typ, opts))
    return out


def _extra_values(name, typ, opts) -> int:
    n = 0
    if opts.get("control_after_generate") or (typ == "INT" and name in ("seed", "noise_seed")):
        n += 1
    if any(opts.get(flag) for flag in UPLOAD_FLAGS):
        n += 1
    return n


def ui_to_api(workflow: Union[dict, str, Path], input_types: Callable[[str], Optional[Mapping]],
              widget_overrides: Optional[Mapping] = None) -> dict:
    """``input_types(class_type)`` returns the node's INPUT_TYPES dict (None if unknown).
    ``widget_overrides``: {node_id (int or str): {input_name: value}} applied after the conversion."""
    if not isinstance(workflow, dict):
        workflow = json.loads(Path(workflow).read_text())
    links = {}
    for link in workflow.get("links", []):
        if isinstance(link, dict):
            links[link["id"]] = (link["origin_id"], link["origin_slot"])
        else:
            lid, src, src_slot, _dst, _dst_slot, _typ = link
            links[lid] = (src, src_slot)
    dropped = {n["id"] for n in workflow["nodes"] if n["type"] in FRONTEND_ONLY or n.get("mode", 0) in (2, 4)}
    prompt = {}
    for node in workflow["nodes"]:
        if node["id"] in dropped:
            continue
        ctype = node["type"]
        types = input_types(ctype)
        if types is None:
            raise WorkflowConversionError(f"node {node['id']}: unknown node type {ctype!r}")
        linked = {}
        for inp in node.get("inputs", []) or []:
            if inp.get("link") is not None:
                if inp["link"] not in links:
                    raise WorkflowConversionError(f"node {node['id']}: input {inp['name']} uses missing link {inp['link']}")
                src, slot = links[inp["link"]]
                if src in dropped:
                    raise WorkflowConversionError(f"node {node['id']}: input {inp['name']} comes from a dropped node")
                linked[inp["name"]] = [str(src), int(slot)]
        values = list(node.get("widgets_values") or [])
        if isinstance(node.get("widgets_values"), dict):
            raise WorkflowConversionError(f"node {node['id']} ({ctype}): dict widgets_values are not supported")
        inputs, pos = {}, 0
        for name, typ, opts in schema_inputs(types):
            if _is_widget(typ, opts):
                if pos >= len(values):
                    if name in linked or opts.get("optional") or name in (types.get("optional") or {}):
                        if name in linked:
                            inputs[name] = linked[name]
                        continue
                    raise WorkflowConversionError(
                        f"node {node['id']} ({ctype}): no widget value for {name!r} (has {len(values)} values)")
                inputs[name] = values[pos]
                pos += 1 + _extra_values(name, typ, opts)
            if name in linked:
                inputs[name] = linked[name]
        if pos != len(values):
            raise WorkflowConversionError(
                f"node {node['id']} ({ctype}): {len(values)} widget values but the schema has widgets for "
                f"{pos} (widget order/count does not match the node's schema): {values}")
        unknown = set(linked) - {n for n, _, _ in schema_inputs(types)}
        if unknown:
            raise WorkflowConversionError(f"node {node['id']} ({ctype}): links into unknown inputs {sorted(unknown)}")
        prompt[str(node["id"])] = {"class_type": ctype, "inputs": inputs,
                                   "_meta": {"title": node.get("title") or ctype}}
    for nid, changes in (widget_overrides or {}).items():
        prompt[str(nid)]["inputs"].update(changes)
    return prompt


def from_node_classes(node_classes: Mapping) -> Callable[[str], Optional[Mapping]]:
    """``input_types`` for :func:`ui_to_api` from ComfyUI's NODE_CLASS_MAPPINGS (in-process)."""
    def get(ctype):
        cls = node_classes.get(ctype)
        return None if cls is None else cls.INPUT_TYPES()
    return get


def from_object_info(object_info: Mapping) -> Callable[[str], Optional[Mapping]]:
    """``input_types`` from a ``GET /object_info`` answer (uses ``input_order`` when present)."""
    def get(ctype):
        info = object_info.get(ctype)
        if info is None:
            return None
        order = info.get("input_order") or {}
        out = {}
        for section in ("required", "optional"):
            entries = (info.get("input") or {}).get(section) or {}
            names = order.get(section) or list(entries)
            out[section] = {n: entries[n] for n in names if n in entries}
        return out
    return get
