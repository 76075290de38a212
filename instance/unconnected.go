package instance

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// unconnected watches the kv_transfer_params sent to an engine started without
// --kv-transfer-config. As in vLLM they are ignored — the engine computes the prompt itself and
// holds nothing for a decoder — but an engine behind a P/D proxy without a connector silently
// stops P/D, so they are counted (GET /v1/kv_transfer's ignored_kv_transfer_params) and warned
// about at most once a minute.
type unconnected struct {
	log     *slog.Logger
	ignored atomic.Int64

	mu   sync.Mutex
	last time.Time // of the last warning
}

// observe implements openai.Config.CheckKV for an engine without a connector: it refuses
// nothing.
func (u *unconnected) observe(params map[string]any) error {
	if params["do_remote_prefill"] != true && params["do_remote_decode"] != true {
		return nil
	}
	n := u.ignored.Add(1)
	now := time.Now()
	u.mu.Lock()
	warn := u.last.IsZero() || now.Sub(u.last) >= time.Minute
	if warn {
		u.last = now
	}
	u.mu.Unlock()
	if warn {
		u.log.Warn("kv_transfer_params ignored: this engine has no --kv-transfer-config, so it neither pulls a prefill engine's KV nor holds its own for a decoder, and computes every prompt itself; "+
			`start it with --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}' (or kv_producer)`, "ignored", n)
	}
	return nil
}

// info is GET /v1/kv_transfer without a connector.
func (u *unconnected) info() any {
	return map[string]any{"kv_connector": nil, "ignored_kv_transfer_params": u.ignored.Load()}
}
