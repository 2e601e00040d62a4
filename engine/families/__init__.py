"""One room per model family: each owns its detection, loading, facts, rules, plan and outputs."""
