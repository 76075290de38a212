package main

import (
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// logLines decodes every line of a process's stderr as a JSON log record; it fails the test on
// a line that is not one (go-redis's or anyone's unstructured print).
func logLines(t *testing.T, p *process) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.Lines(p.log()) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("a log line that is not JSON: %q: %v", line, err)
		}
		for _, k := range []string{"time", "level", "msg"} {
			if _, ok := rec[k]; !ok {
				t.Fatalf("log line without %q: %q", k, line)
			}
		}
		out = append(out, rec)
	}
	return out
}

// withMsg returns the first record whose message contains s, or nil.
func withMsg(recs []map[string]any, s string) map[string]any {
	for _, r := range recs {
		if msg, _ := r["msg"].(string); strings.Contains(msg, s) {
			return r
		}
	}
	return nil
}

// TestServeLogsJSON: `serve --log-format json --log-level debug` writes only JSON lines, with a
// debug line, the address it is bound to (reachable), the shared attribute keys, and on SIGTERM
// a shutdown line and a closed line, exiting 0.
func TestServeLogsJSON(t *testing.T) {
	p := startProcess(t, []string{"VLLM_NIXL_SIDE_CHANNEL_PORT=0"}, serveArgs("--log-format", "json", "--log-level", "debug", "--swap-space", "4",
		"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`)...)
	resp, err := http.Get(p.url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if err := p.stop(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, p.log())
	}
	recs := logLines(t, p)
	debug := withMsg(recs, "accepted for vLLM compatibility")
	if debug == nil || debug["level"] != "DEBUG" || debug["flag"] != "--swap-space" {
		t.Errorf("--log-level debug: no debug line for --swap-space: %v", debug)
	}
	serving := withMsg(recs, "kvbridge serving")
	if serving == nil {
		t.Fatalf("no serving line:\n%s", p.log())
	}
	addr, _ := serving["addr"].(string)
	if addr != "127.0.0.1:"+port(t, p.url) || serving["url"] != "http://"+addr {
		t.Errorf("serving line: addr %v, url %v; want the bound address 127.0.0.1:%s and its URL", serving["addr"], serving["url"], port(t, p.url))
	}
	if _, ok := serving["engine_id"].(string); !ok {
		t.Errorf("serving line has no engine_id: %v", serving)
	}
	for _, r := range recs {
		for _, k := range []string{"error", "req", "request", "req_id", "requestID", "engine"} {
			if _, ok := r[k]; ok {
				t.Errorf("log line with key %q instead of the shared key set (docs/architecture.md): %v", k, r)
			}
		}
	}
	down := withMsg(recs, "shutting down")
	if down == nil || !strings.Contains(down["cause"].(string), "terminated") {
		t.Errorf("no shutdown line naming the signal: %v\n%s", down, p.log())
	}
	if withMsg(recs, "kvbridge serve: closed") == nil {
		t.Errorf("no closed line:\n%s", p.log())
	}
}

// TestProxyLogsBoundAddress: a proxy started without --host listens on every interface and
// says so (addr=[::]:PORT), with a URL that reaches it; SIGTERM logs the shutdown.
func TestProxyLogsBoundAddress(t *testing.T) {
	px := startProcess(t, nil, "proxy", "--port", "0", "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", "1",
		"--decoder-hosts", "127.0.0.1", "--decoder-ports", "1")
	line, p := px.log(), port(t, px.url)
	// [::] where the machine has IPv6 (both families), 0.0.0.0 where it has not.
	if !strings.Contains(line, "addr=[::]:"+p+" ") && !strings.Contains(line, "addr=0.0.0.0:"+p+" ") {
		t.Errorf("proxy's listening line does not name the bound address, every interface on port %s: %s", p, line)
	}
	resp, err := http.Get(px.url + "/healthcheck")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err := px.stop(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, px.log())
	}
	for _, want := range []string{"kvbridge proxy: shutting down", "kvbridge proxy: closed"} {
		if !strings.Contains(px.log(), want) {
			t.Errorf("no %q line:\n%s", want, px.log())
		}
	}
}

// TestLogLevel: --log-level wins over VLLM_LOGGING_LEVEL, which takes vLLM's names in any case;
// a bad value is a usage error naming the flag or the variable.
func TestLogLevel(t *testing.T) {
	for _, tc := range []struct {
		env, flag string
		want      slog.Level
		bad       string
	}{
		{want: slog.LevelInfo},
		{env: "DEBUG", want: slog.LevelDebug},
		{env: "warn", want: slog.LevelWarn},
		{env: "Critical", want: slog.LevelError},
		{env: "DEBUG", flag: "error", want: slog.LevelError},
		{env: "loud", bad: logLevelEnv},
		{env: "debug", flag: "verbose", bad: "--log-level"},
	} {
		t.Setenv(logLevelEnv, tc.env)
		var lf logFlags
		fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
		lf.register(fs)
		args := []string{}
		if tc.flag != "" {
			args = append(args, "--log-level", tc.flag)
		}
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		log, err := lf.logger(io.Discard)
		if tc.bad != "" {
			if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), tc.bad) {
				t.Errorf("env %q flag %q: %v; want a usage error naming %s", tc.env, tc.flag, err, tc.bad)
			}
			continue
		}
		if err != nil {
			t.Fatalf("env %q flag %q: %v", tc.env, tc.flag, err)
		}
		if !log.Enabled(t.Context(), tc.want) || log.Enabled(t.Context(), tc.want-1) {
			t.Errorf("env %q flag %q: the logger's level is not %v", tc.env, tc.flag, tc.want)
		}
	}
}

// TestProxyRoutesRedisLogs: a multi-turn proxy with --log-format json whose Redis is down logs
// go-redis's complaints as JSON lines (component go-redis) like its own, not as go-redis's
// unstructured prints; its readiness says why it is not ready.
func TestProxyRoutesRedisLogs(t *testing.T) {
	dead := fixture.DeadAddr(t) // Redis is down: every dial is refused
	px := startProcess(t, nil, "proxy", "--multi-turn", "--host", "127.0.0.1", "--port", "0", "--log-format", "json",
		"--conversation-store", "redis://"+dead+"/0", "--conversation-store-key", "logging-test-key", "--prefiller-ports", "1", "--decoder-ports", "1")
	resp, err := http.Get(px.url + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "store") {
		t.Errorf("/ready with Redis down: %d %s; want 503 naming the store", resp.StatusCode, body)
	}
	if !px.waitLog(t, `"component":"go-redis"`) {
		t.Errorf("no go-redis line through the proxy's logger:\n%s", px.log())
	}
	if err := px.stop(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, px.log())
	}
	logLines(t, px) // every line, go-redis's included, is a JSON record
}
