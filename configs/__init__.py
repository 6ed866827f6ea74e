"""Presets as plain data: model shapes in `models/*.json` (ModelConfig.to_dict form)."""
