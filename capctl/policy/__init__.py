"""Policy files: YAML schema, loading and validation with file:line:col errors."""
