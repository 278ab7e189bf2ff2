"""Human-readable reports of what fusion did (for OPWEAVE_DEBUG and `opweave explain`)."""
from __future__ import annotations


def partition_report(lowered) -> str:
    part = lowered.partition
    if part is None:
        return "fusion is off: every op runs as its own step\n"
    lines = [f"partition by {part.method}: {len(part.groups)} steps, {len(part.fused)} fused "
             f"groups, estimated {part.estimated_seconds() * 1e3:.3f} ms, solved in "
             f"{part.seconds:.3f} s ({part.components} components, {part.cache_hits} from cache)"]
    lines += [f"note: {n}" for n in lowered.notes]
    for i, step in enumerate(lowered.steps):
        nodes = ", ".join(f"{n.outputs[0].name}={n.op}" for n in step.nodes)
        if len(step.nodes) > 1 or step.kind != "op":
            lines.append(f"[{i}] {step.kind} {step.name}: {nodes}")
        else:
            node = step.nodes[0]
            lines.append(f"[{i}] {node.op} {node.outputs[0].name} alone: {part.why_alone(node)}")
    return "\n".join(lines) + "\n"
