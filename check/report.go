package check

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
)

// Finding is one problem check found: its name (one of the Problem constants) and what it saw.
type Finding struct {
	Problem string
	Detail  string
}

// Report is what check found.
type Report struct {
	// Proxy is the proxy checked; MultiTurn says it is `kvbridge proxy --multi-turn`.
	Proxy     string
	MultiTurn bool
	// Lines are the facts, in the order they were established.
	Lines []string
	// Problems are what is wrong; none means P/D is working.
	Problems []Finding
	// Compared says the proxy's answer was compared with an engine's own (and was equal, unless
	// a problem says otherwise).
	Compared bool
}

// OK reports whether the deployment was seen disaggregating, with nothing wrong.
func (r *Report) OK() bool { return len(r.Problems) == 0 }

// Has reports whether problem was found.
func (r *Report) Has(problem string) bool {
	return slices.ContainsFunc(r.Problems, func(f Finding) bool { return f.Problem == problem })
}

// problem records a problem, once per name and detail.
func (r *Report) problem(name, format string, args ...any) {
	f := Finding{Problem: name, Detail: fmt.Sprintf(format, args...)}
	if !slices.Contains(r.Problems, f) {
		r.Problems = append(r.Problems, f)
	}
}

func (r *Report) line(format string, args ...any) {
	r.Lines = append(r.Lines, fmt.Sprintf(format, args...))
}

// Print writes the report for a person: the facts, each problem, and the verdict.
func (r *Report) Print(w io.Writer) {
	kind := "one-way"
	if r.MultiTurn {
		kind = "multi-turn"
	}
	fmt.Fprintf(w, "kvbridge check: proxy %s (%s)\n", r.Proxy, kind)
	for _, l := range r.Lines {
		fmt.Fprintf(w, "  %s\n", l)
	}
	for _, f := range r.Problems {
		fmt.Fprintf(w, "PROBLEM %s: %s\n", f.Problem, f.Detail)
	}
	if r.OK() {
		also := ""
		if r.Compared {
			also = ", and the answer equals the prefill engine's own"
		}
		fmt.Fprintf(w, "verdict: OK — P/D is working: D pulled the prompts' KV from P%s\n", also)
		return
	}
	var names []string
	for _, f := range r.Problems {
		if !slices.Contains(names, f.Problem) {
			names = append(names, f.Problem)
		}
	}
	fmt.Fprintf(w, "verdict: NOT P/D — %s\n", strings.Join(names, "; "))
}

// configuration judges what the engines say of their connectors.
func (r *Report) configuration(engines []*engine) {
	var tokens, hashes = map[bool][]string{}, map[string][]string{}
	var reported []*engine // with a connector
	for _, e := range engines {
		switch {
		case e.err != nil:
			r.problem(ProblemUnreachable, "%s engine %s: %v", e.leg, e.url, e.err)
			continue
		case e.info == nil:
			r.line("%-7s %s: does not report its connector (GET /v1/kv_transfer: not a kvbridge engine?)", e.leg, e.url)
			continue
		case e.info.Connector == nil || *e.info.Connector == "":
			r.line("%-7s %s: no connector", e.leg, e.url)
			r.problem(ProblemNoConnector, "the %s engine %s runs without --kv-transfer-config: start it with "+
				`--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"%s"}'`, e.leg, e.url, wantRole(e.leg))
			continue
		}
		in := e.info
		r.line("%-7s %s: %s %s, engine %s, auth token %s, bidirectional %v, backends %s", e.leg, e.url, *in.Connector, in.Role,
			in.EngineID, yesNo(in.AuthToken), in.Bidirectional, orAuto(in.Backends))
		if in.Role != "kv_both" && in.Role != wantRole(e.leg) {
			r.problem(ProblemSwapped, "the %s engine %s is a %s: the proxy's --prefill must name kv_producer engines and --decode kv_consumer ones", e.leg, e.url, in.Role)
		}
		tokens[in.AuthToken] = append(tokens[in.AuthToken], e.url)
		hashes[in.CompatibilityHash] = append(hashes[in.CompatibilityHash], e.url)
		reported = append(reported, e)
	}
	switch {
	case len(tokens[true]) > 0 && len(tokens[false]) == 0:
		r.line("auth token: set on every engine with a connector (whether the tokens are equal shows in the transfers below)")
	case len(tokens[false]) > 0 && len(tokens[true]) == 0:
		r.line("auth token: none on any engine with a connector")
	}
	if len(hashes) == 1 {
		for h := range hashes {
			r.line("compatibility hash: %s on every engine with a connector", h)
		}
	}
	if len(tokens[true]) > 0 && len(tokens[false]) > 0 {
		r.problem(ProblemAuth, "an auth token is set on %s but not on %s: set the same KVBRIDGE_KV_AUTH_TOKEN (or kv_connector_extra_config.auth_token) on every engine, or none",
			strings.Join(tokens[true], ", "), strings.Join(tokens[false], ", "))
	}
	if len(hashes) > 1 {
		parts := compatDiff(reported)
		if len(parts) == 0 { // engines that do not say what their hashes cover
			for h, us := range hashes {
				parts = append(parts, fmt.Sprintf("%s on %s", h, strings.Join(us, ", ")))
			}
			slices.Sort(parts)
		}
		r.problem(ProblemCompat, "the engines' compatibility hashes differ (%s): they serve different models, dtypes or KV geometry, so every handshake fails", strings.Join(parts, "; "))
	}
}

// compatDiff names each factor of the compatibility hash on which engines differ, with each
// value and the engines that have it, in the engines' order: `cache_dtype "float32"
// (http://p:8100) vs "bfloat16" (http://d:8200)`. Engines that do not report the factors are
// left out.
func compatDiff(engines []*engine) []string {
	var keys []string
	for _, e := range engines {
		for k := range e.info.Compatibility {
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	slices.Sort(keys)
	var parts []string
	for _, k := range keys {
		var values []string         // distinct, in order of first appearance
		on := map[string][]string{} // value → engines
		for _, e := range engines {
			if e.info.Compatibility == nil {
				continue
			}
			raw := "(none)"
			if v, ok := e.info.Compatibility[k]; ok {
				if b, err := json.Marshal(v); err == nil {
					raw = string(b)
				}
			}
			if _, seen := on[raw]; !seen {
				values = append(values, raw)
			}
			on[raw] = append(on[raw], e.url)
		}
		if len(values) < 2 {
			continue
		}
		var each []string
		for _, v := range values {
			each = append(each, v+" ("+strings.Join(on[v], ", ")+")")
		}
		parts = append(parts, k+" "+strings.Join(each, " vs "))
	}
	return parts
}

func wantRole(leg string) string {
	if leg == "prefill" {
		return "kv_producer"
	}
	return "kv_consumer"
}

// requests judges the answers the proxy gave.
func (r *Report) requests(answers []answer) {
	ok := 0
	for _, a := range answers {
		if a.status == http.StatusOK {
			ok++
			continue
		}
		msg := a.errMsg
		if strings.Contains(msg, "swapped") {
			r.problem(ProblemSwapped, "the proxy answered %d: %s", a.status, msg)
			continue
		}
		r.problem(ProblemRequests, "the proxy answered %d: %s", a.status, msg)
	}
	r.line("requests: %d sent through the proxy (temperature 0), %d answered 200", len(answers), ok)
}

// conversation sends two turns of one conversation through a multi-turn proxy and checks that
// the second pulled the first's KV back from D.
func (r *Report) conversation(ctx context.Context, c client, proxy, model, nonce string) {
	conv := "kvbridge-check-" + nonce
	msgs := []map[string]any{{"role": "user", "content": longPrompt(nonce, 99)}}
	first := ask(ctx, c, proxy+"/v1/chat/completions", map[string]any{"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0, "conversation_id": conv})
	if first.status != http.StatusOK {
		r.problem(ProblemRequests, "a conversation's first turn: %d %s", first.status, first.errMsg)
		return
	}
	msgs = append(msgs, map[string]any{"role": "assistant", "content": first.text}, map[string]any{"role": "user", "content": "And then?"})
	second := ask(ctx, c, proxy+"/v1/chat/completions", map[string]any{"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0, "conversation_id": conv})
	if second.status != http.StatusOK {
		r.problem(ProblemRequests, "a conversation's second turn: %d %s", second.status, second.errMsg)
		return
	}
	cache := second.header.Get("X-KVBridge-Cache")
	r.line("conversation: second turn %s (X-KVBridge-Cache), %s tokens pulled from D by P", cache, orUnknown(second.header.Get("X-KVBridge-Prefill-Pulled-Tokens")))
	if cache != "hit" {
		r.problem(ProblemNotReused, "the second turn of a conversation was a cache %q: start every engine with kv_connector_extra_config.bidirectional_kv_xfer=true", cache)
	}
}

// compare checks the proxy's answer against the same prompt recomputed on one engine.
func (r *Report) compare(pd, ref answer, engineURL string) {
	if ref.status != http.StatusOK {
		r.line("outputs: the reference request to %s failed (%d %s): not compared", engineURL, ref.status, ref.errMsg)
		return
	}
	r.Compared = true
	if pd.text != ref.text {
		r.problem(ProblemOutputs, "at temperature 0 the proxy answered %q, the prefill engine alone %q", clip([]byte(pd.text)), clip([]byte(ref.text)))
		return
	}
	r.line("outputs: identical to %s's own answer to the same prompt (temperature 0)", engineURL)
}

// transfers judges whether KV moved: the engines' metrics and connectors, D's usage and the
// proxy's counts.
func (r *Report) transfers(engines []*engine, answers []answer, before, after map[string]any) {
	// What the proxy counted.
	if n := withoutTransfer(after, "prefill_returned_no_params") - withoutTransfer(before, "prefill_returned_no_params"); n > 0 {
		r.problem(ProblemNoConnector, "the proxy counted %.0f request(s) whose prefill instance returned no kv_transfer_params: the prefill instance has no --kv-transfer-config (kv_producer)", n)
	}
	if n := withoutTransfer(after, "decode_pulled_nothing") - withoutTransfer(before, "decode_pulled_nothing"); n > 0 {
		r.problem(ProblemNotPulled, "the proxy counted %.0f request(s) for which the decode instance pulled nothing", n)
	}

	// Tokens: prompt_tokens_by_source on D when it exports it, else D's usage.
	t := kvTally{pulled: -1}
	for _, a := range answers {
		t.prompt += a.prompt
	}
	for _, e := range engines {
		if e.err != nil || e.before == nil || e.after == nil {
			continue
		}
		t.addMetrics(e)
		if e.info != nil && e.infoEnd != nil {
			r.connectorChanges(e, &t)
		}
	}
	if t.pulled < 0 {
		for _, a := range answers {
			if a.details {
				t.pulled, t.source = max(t.pulled, 0)+a.external, "D's usage.prompt_tokens_details.external_cached_tokens"
			}
		}
	}
	if t.known {
		r.movedKV(&t)
	}
	r.pulledTokens(&t)
}

// kvTally is what transfers gathers from the engines and the answers.
type kvTally struct {
	prompt, pulled  int    // prompt tokens sent and pulled from P (−1: unknown)
	source          string // where pulled comes from
	byBytes, failed float64
	known           bool // an engine's metrics were read before and after
	shm, tcp        bool // KV was read over SHM, over TCP
}

// addMetrics adds what engine e's metrics moved.
func (t *kvTally) addMetrics(e *engine) {
	t.known = true
	if e.leg == "decode" {
		if n, ok := delta(e.before, e.after, "vllm:prompt_tokens_by_source_total", `source="external_kv_transfer"`); ok {
			if t.pulled < 0 {
				t.pulled, t.prompt = 0, 0 // D's own count of its prompts, conversations included
			}
			all, _ := delta(e.before, e.after, "vllm:prompt_tokens_by_source_total")
			t.pulled, t.prompt, t.source = t.pulled+int(n), t.prompt+int(all), "vllm:prompt_tokens_by_source_total"
		}
	}
	b, _ := delta(e.before, e.after, "vllm:nixl_bytes_transferred_sum")
	t.byBytes += b
	f, _ := delta(e.before, e.after, "vllm:nixl_num_failed_transfers_total")
	t.failed += f
}

// connectorChanges judges what engine e's connector counted (e.info and e.infoEnd set) and notes
// the backends that moved KV in t.
func (r *Report) connectorChanges(e *engine, t *kvTally) {
	if n := e.infoEnd.IgnoredParams - e.info.IgnoredParams; n > 0 {
		r.problem(ProblemNoConnector, "the %s engine %s ignored the kv_transfer_params of %d request(s): it has no --kv-transfer-config", e.leg, e.url, n)
	}
	// A reader that pulled bytes (or, in push mode, a writer that pushed them) while no engine
	// served them over TCP moved them through an arena it mapped (SHM maps a peer's arena once,
	// so mapped bytes need not grow).
	moved := e.infoEnd.BytesRead > e.info.BytesRead || e.infoEnd.BytesWritten > e.info.BytesWritten
	if moved && e.infoEnd.MappedBytes > 0 {
		t.shm = true
	}
	if e.infoEnd.ServedTCPReadBytes > e.info.ServedTCPReadBytes || e.infoEnd.ServedTCPWriteBytes > e.info.ServedTCPWriteBytes {
		t.tcp = true
	}
	if n := e.infoEnd.ParamsAuthMismatch - e.info.ParamsAuthMismatch; n > 0 {
		r.problem(ProblemAuth, "the %s engine %s refused %d of the prefill engine's kv_transfer_params: the auth token of the engine that issued them differs from its own; set the same KVBRIDGE_KV_AUTH_TOKEN on every engine", e.leg, e.url, n)
	}
	if n := e.infoEnd.Refusals.SideChannel + e.infoEnd.Refusals.Transfer - e.info.Refusals.SideChannel - e.info.Refusals.Transfer; n > 0 {
		r.problem(ProblemAuth, "the %s engine %s refused %d side-channel or transfer connections for authentication: set the same KVBRIDGE_KV_AUTH_TOKEN on every engine, or none", e.leg, e.url, n)
	}
}

// movedKV reports the KV bytes the engines moved and the transfers that failed.
func (r *Report) movedKV(t *kvTally) {
	backend := ""
	switch {
	case t.tcp:
		backend = " over TCP" // an engine that maps a peer's arena may still read another over TCP
	case t.shm:
		backend = " over SHM"
	}
	r.line("KV moved: %s%s (vllm:nixl_bytes_transferred), %.0f failed transfers (vllm:nixl_num_failed_transfers)", bytesText(t.byBytes), backend, t.failed)
	if t.byBytes == 0 {
		r.problem(ProblemNotPulled, "the engines moved no KV (vllm:nixl_bytes_transferred did not grow): D computed every prompt itself")
	}
	if t.failed > 0 {
		r.problem(ProblemNotPulled, "%.0f KV transfers failed: see the decode engine's log (handshake, compatibility hash, auth token)", t.failed)
	}
}

// pulledTokens reports how many prompt tokens D pulled, when known.
func (r *Report) pulledTokens(t *kvTally) {
	prompt, pulled, source := t.prompt, t.pulled, t.source
	if pulled >= 0 && prompt > 0 {
		r.line("prompt tokens: %d sent, %d pulled from P, %d computed on D (%s)", prompt, pulled, prompt-pulled, source)
		if pulled == 0 && prompt > 0 {
			r.problem(ProblemNotPulled, "D pulled none of the %d prompt tokens (%s)", prompt, source)
		}
	} else if pulled < 0 && prompt > 0 {
		r.line("prompt tokens: %d sent; how many were pulled is unknown (D exports no vllm:prompt_tokens_by_source_total and its usage no prompt_tokens_details: start it with --enable-prompt-tokens-details)", prompt)
	}
	if !t.known && pulled < 0 && r.OK() {
		r.problem(ProblemNotPulled, "cannot tell whether any KV moved: give the engines' URLs (--prefill, --decode) or start D with --enable-prompt-tokens-details")
	}
}

func bytesText(b float64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", b/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", b/(1<<10))
	}
	return fmt.Sprintf("%.0f B", b)
}

func yesNo(b bool) string {
	if b {
		return "set"
	}
	return "none"
}

func orAuto(b []string) string {
	if len(b) == 0 {
		return "auto"
	}
	return strings.Join(b, ",")
}

func orUnknown(s string) string {
	if s == "" {
		return "an unknown number of"
	}
	return s
}
