// Package metrics owns kvbridge's Prometheus metrics and the periodic "KV Transfer metrics" log
// line. Series names, label names and histogram buckets follow vLLM's v1 metrics so dashboards
// and scrapers written for vLLM work unchanged.
//
// There is no package-level state: NewRegistry returns a Registry that holds its own
// prometheus.Registry and collectors. Registry.Engine returns the per-engine view (labels
// model_name and engine) that the HTTP layer, the engine (through the instance, which maps its
// reports: the package knows no engine) and the connector record into; EngineMetrics.Configure
// adds the series that depend on the engine's configuration (the token-count histograms, whose
// buckets follow max_model_len, and vllm:cache_config_info). Series of kvbridge's own, which
// vLLM lacks, are named kvbridge:….
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package metrics
