"""The teachers of on-policy distillation: one (`teacher.model_path`), or one per data source (MOPD,
`teacher.by_data_source`), each a forward-only engine built as the reference is. `Teachers.infer_batch` scores each
row with its data source's teacher, so the step reads one `(B, T)` of teacher log-probs whatever the routing."""

from __future__ import annotations

import torch

from shardrl.config.schema import Config, ConfigError


def teacher_of(cfg: Config, data_source: str) -> str | None:
    """The folder of the teacher that scores rows of `data_source` (None: no teacher covers it)."""
    return cfg.teacher.by_data_source.get(data_source, cfg.teacher.model_path)


def check_teacher_sources(cfg: Config, data_sources) -> None:
    """Every training row's data source has a teacher: without `teacher.model_path` (the default teacher), a data
    source `teacher.by_data_source` does not name would only fail at the step that first draws it."""
    missing = sorted({s for s in data_sources if teacher_of(cfg, s) is None})
    if missing:
        named = ", ".join(sorted(cfg.teacher.by_data_source)) or "none"
        raise ConfigError(f"teacher.by_data_source names no teacher for the training data's data_source "
                          f"{', '.join(map(repr, missing))} (it names {named}) and teacher.model_path is unset: add "
                          "them to teacher.by_data_source, or set teacher.model_path as the teacher of the others")


class Teachers:
    """The run's teacher engines by folder, and which one scores each data source."""

    def __init__(self, cfg: Config, build):
        """`build(path)`: a forward-only engine of the model at `path` (`roles.build_reference`)."""
        self.cfg = cfg
        self.engines = {path: build(path) for path in cfg.teacher.paths()}

    def infer_batch(self, batch, **kwargs):
        """The engine's `infer_batch` outputs `(B, T)` for `batch`, each row from its data source's teacher. Every
        rank calls every teacher, in the same order, with its rows for it (perhaps none): a sharded engine's
        forwards are collective."""
        if not self.cfg.teacher.by_data_source:  # one teacher for every row
            return next(iter(self.engines.values())).infer_batch(batch, **kwargs)
        sources = batch["data_source"]
        unscored = [s for s in sources if teacher_of(self.cfg, s) is None]
        if unscored:  # check_teacher_sources covers the training data; a row from elsewhere (an agent) lands here
            raise ConfigError(f"no teacher for data_source {unscored[0]!r}: add it to teacher.by_data_source, or set "
                              "teacher.model_path as the default teacher")
        if len(self.engines) == 1:
            return next(iter(self.engines.values())).infer_batch(batch, **kwargs)
        out = {}
        for path, engine in self.engines.items():
            rows = [i for i, s in enumerate(sources) if teacher_of(self.cfg, s) == path]
            part = engine.infer_batch(batch.index(rows), **kwargs)
            if part is None:  # no micro-batch ran on any rank
                continue
            for key in part.keys():
                value = part[key]
                if key not in out:
                    out[key] = value.new_zeros((len(batch), *value.shape[1:]))
                out[key][torch.as_tensor(rows, dtype=torch.long, device=value.device)] = value
        return out
