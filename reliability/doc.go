// Package reliability holds kvbridge's fault-injection suite (tests only): real engines,
// connectors, transfer agents and proxies on 127.0.0.1 — in this process, or as child
// processes where the fault is a process death — with a fault proxy (package faultproxy) on the
// HTTP legs, the side channel and the transfer path. Each case asserts the client's outcome
// (status and body), a bounded wait, full block pools on the survivors, no leaked goroutines
// (in-process cases) and the failure in the metrics. docs/reliability.md lists the cases.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package reliability
