"""Model architectures, one package per family (llama/, deepseek_v3/, deepseek_v4/), listed
in one registry (registry.py); what every model takes and returns (launch.py), the layers a
backend supplies (kit.py) and the pieces families share (layers.py, moe.py)
(docs/architecture.md §8)."""
