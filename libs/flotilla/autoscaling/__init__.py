"""Autoscaling law: the pure control law (`control`), its inputs (`signals`), the pool policy (`policy`) and
the router's pool-signals client (`router_client`), shared by the local autoscaler and the operator."""
