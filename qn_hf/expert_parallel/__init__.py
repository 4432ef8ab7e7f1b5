"""Expert parallelism: ``apply.py`` shards every MoE layer's experts over ep ranks; ``dispatch.py`` runs
one experts call with tokens sent to their experts by ``token_exchange.py`` (the all-to-alls);
``router_loss.py`` computes the routers' load-balancing loss over the whole step's batch. What ep costs, for the
planner: ``costs.py`` (the dispatch's stand-in in its meta trace, the all-to-alls' traffic) and
``routing_costs.py`` (the routers' measured loads: the busiest rank's share)."""
