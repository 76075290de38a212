// Package grafana holds kvbridge's Grafana dashboard for disaggregated prefill/decode
// (kvbridge-pd.json: import it into Grafana and pick the Prometheus data source that scrapes
// every engine's /metrics) and the test that keeps it true: the file is a Grafana dashboard of
// the expected shape, and every series its panels' PromQL queries exists on a running P and D
// after a P/D request through the proxy.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package grafana
