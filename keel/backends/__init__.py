"""Who executes: one package per backend, the same file names in each."""
