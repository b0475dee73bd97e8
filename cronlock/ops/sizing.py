"""Connection limits for a deployment: N instances behind PgBouncer and nginx.

The rule the deployment docs cite; the tests' cluster (tests/support/cluster.py) and
deploy/ are configured with it.
"""

from __future__ import annotations


def sizing(instances: int, pool_per_instance: int, burst: int = 1000) -> dict[str, int]:
    """Connection limits for `instances` app processes with asyncpg pools of `pool_per_instance`,
    taking `burst` concurrent triggers through the load balancer at once.

    - PgBouncer `default_pool_size` = instances x pool: a cron run holds its server connection
      for its whole transaction (that is where the advisory lock lives), so a smaller pool
      would make lock attempts queue inside PgBouncer instead of answering "skipped" at once.
      PgBouncer's worth here is multiplexing idle clients and absorbing instance churn.
    - PgBouncer `reserve_pool_size` = one instance's pool: room for a restarting instance
      whose predecessor's connections have not been closed yet.
    - PgBouncer `max_client_conn` = 2 x instances x pool + 20: during a rolling restart old
      and new processes are both connected; 20 for CLI runs, migrations and monitoring.
    - PostgreSQL `max_connections` = default_pool_size + reserve_pool_size + instances
      (one direct LISTEN connection each, which cannot go through transaction pooling)
      + 10 (psql, migrations, backups) + 3 (superuser_reserved_connections).
    - nginx `worker_connections` >= 2 x concurrent client requests + upstream keepalive: each
      proxied request holds a client and an upstream connection. A storm of skips is cheap for
      the instances but not for nginx: size it for the whole burst, never below 1024.
    - nginx upstream `keepalive` = instances x pool: one idle connection per request an
      instance can serve at once, so steady load opens no new TCP connections.
    """
    if instances < 1 or pool_per_instance < 1:
        raise ValueError("instances and pool_per_instance must be at least 1")
    pooled = instances * pool_per_instance
    reserve = pool_per_instance
    keepalive = pooled
    return {
        "pgbouncer_default_pool_size": pooled,
        "pgbouncer_reserve_pool_size": reserve,
        "pgbouncer_max_client_conn": 2 * pooled + 20,
        "postgres_max_connections": pooled + reserve + instances + 10 + 3,
        "nginx_worker_connections": max(1024, 2 * burst + keepalive),
        "nginx_keepalive": keepalive,
    }
