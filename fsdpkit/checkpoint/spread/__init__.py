"""convert, reshard and verify spread over processes and nodes: the plan, the staging area, the runner."""
