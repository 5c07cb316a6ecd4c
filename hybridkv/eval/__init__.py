"""Long-context evaluation: task generators, scorers, the runner (through the engine, with a
memory policy), and reports (JSON, markdown tables, PNG plots)."""
