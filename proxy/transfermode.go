package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

// TransferMode says how a proxy has the KV of a request moved from P to D (Config.TransferMode,
// `kvbridge proxy --transfer-mode`).
type TransferMode string

// The transfer modes.
const (
	// TransferAuto (the default) decides per prefill engine from its GET /v1/kv_transfer:
	// TransferPush when it reports transfer_mode "push" (or kv_connector "NixlPushConnector"),
	// TransferPull otherwise, including for engines without that route (vLLM's).
	TransferAuto TransferMode = "auto"
	// TransferPull is the pull flow: P's leg, then D's with P's params; D READs P's blocks.
	TransferPull TransferMode = "pull"
	// TransferPush is the concurrent push flow (ai-dynamo/dynamo #13311's): both legs at once,
	// tied by a push_id the proxy draws; D registers its blocks with P, P WRITEs the KV into
	// them. It needs P's coordinates from P's GET /v1/kv_transfer; without them a request
	// falls back to TransferPushSerial.
	TransferPush TransferMode = "push"
	// TransferPushSerial is vLLM's toy push proxy's flow: P's leg as in pull, then D's with P's
	// coordinates and no remote_block_ids; D registers with P, P WRITEs.
	TransferPushSerial TransferMode = "push-serial"
)

// TransferModes lists the accepted values of TransferMode, the default first.
var TransferModes = []TransferMode{TransferAuto, TransferPull, TransferPush, TransferPushSerial}

// ParseTransferMode returns the mode s names ("" is TransferAuto).
func ParseTransferMode(s string) (TransferMode, error) {
	if s == "" {
		return TransferAuto, nil
	}
	for _, m := range TransferModes {
		if string(m) == s {
			return m, nil
		}
	}
	return "", fmt.Errorf("transfer mode %q: want one of auto, pull, push, push-serial", s)
}

// PushConnector is the kv_connector name of vLLM's push connector.
const PushConnector = "NixlPushConnector"

// engineInfoTTL is how long a prefill engine's GET /v1/kv_transfer answer is used before it is
// asked again; a failed leg to the engine, or P's params naming another engine id (it
// restarted), drops it sooner.
const engineInfoTTL = 10 * time.Second

// engineInfoTimeout bounds one GET /v1/kv_transfer.
const engineInfoTimeout = 5 * time.Second

// maxEngineInfoBytes bounds the answer read.
const maxEngineInfoBytes = 1 << 20

// engineInfo is what the proxy needs of a prefill engine's GET /v1/kv_transfer.
type engineInfo struct {
	push     bool   // transfer_mode "push", or kv_connector NixlPushConnector
	engineID string // engine_id
	host     string // remote_host: where D reaches P's side channel ("" unknown)
	port     int    // remote_port (0 unknown)
	tpSize   int    // tp_size (0 unknown)
}

// coordinates reports whether the info says where D registers with P: an engine id and a port.
func (e engineInfo) coordinates() bool { return e.engineID != "" && e.port > 0 }

// engineInfos caches the prefill engines' GET /v1/kv_transfer; safe for concurrent use.
type engineInfos struct {
	client *http.Client
	apiKey string

	mu      sync.Mutex
	entries map[Instance]infoEntry
}

type infoEntry struct {
	info    engineInfo
	fetched time.Time
}

func newEngineInfos(client *http.Client, apiKey string) *engineInfos {
	return &engineInfos{client: client, apiKey: apiKey, entries: map[Instance]infoEntry{}}
}

// get returns inst's info, from the cache when it is younger than engineInfoTTL. An engine
// without the route (404) or with an answer that is no JSON object is remembered as a pull
// engine without coordinates; an engine that cannot be reached is an error, not remembered.
func (c *engineInfos) get(ctx context.Context, inst Instance, hdr http.Header) (engineInfo, error) {
	now := time.Now()
	c.mu.Lock()
	e, ok := c.entries[inst]
	c.mu.Unlock()
	if ok && now.Sub(e.fetched) < engineInfoTTL {
		return e.info, nil
	}
	info, err := c.fetch(ctx, inst, hdr)
	if err != nil {
		return engineInfo{}, err
	}
	c.mu.Lock()
	c.entries[inst] = infoEntry{info: info, fetched: now}
	c.mu.Unlock()
	return info, nil
}

// forget drops inst's info, so that the next request asks again.
func (c *engineInfos) forget(inst Instance) {
	c.mu.Lock()
	delete(c.entries, inst)
	c.mu.Unlock()
}

// forgetUnless drops inst's info when it names an engine id other than id (P restarted).
func (c *engineInfos) forgetUnless(inst Instance, id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.entries[inst]; ok && id != "" && e.info.engineID != id {
		delete(c.entries, inst)
	}
}

func (c *engineInfos) fetch(ctx context.Context, inst Instance, hdr http.Header) (engineInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, engineInfoTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, inst.URL("/v1/kv_transfer"), nil)
	if err != nil {
		return engineInfo{}, err
	}
	switch {
	case hdr.Get("Authorization") != "":
		req.Header.Set("Authorization", hdr.Get("Authorization"))
	case c.apiKey != "":
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return engineInfo{}, fmt.Errorf("GET /v1/kv_transfer of %s: %w", inst, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxEngineInfoBytes))
	if err != nil {
		return engineInfo{}, fmt.Errorf("GET /v1/kv_transfer of %s: %w", inst, err)
	}
	if resp.StatusCode/100 != 2 {
		return engineInfo{}, nil // not a kvbridge engine, or an older one: pull
	}
	return parseEngineInfo(data), nil
}

// parseEngineInfo reads GET /v1/kv_transfer's answer; fields of the wrong type count as absent.
func parseEngineInfo(data []byte) engineInfo {
	var m map[string]any
	if json.Unmarshal(data, &m) != nil {
		return engineInfo{}
	}
	str := func(k string) string { s, _ := m[k].(string); return s }
	num := func(k string) int {
		f, ok := m[k].(float64)
		if !ok || f != float64(int(f)) || f <= 0 || f > 1<<30 {
			return 0
		}
		return int(f)
	}
	info := engineInfo{engineID: str("engine_id"), host: str("remote_host"), port: num("remote_port"), tpSize: num("tp_size")}
	info.push = str("transfer_mode") == string(TransferPush) || str("kv_connector") == PushConnector
	if info.port > 65535 {
		info.port = 0
	}
	return info
}

// flow is how one request's KV moves: the mode with auto resolved.
type flow int

const (
	flowPull flow = iota
	flowPush
	flowPushSerial
)

// chooseFlow resolves the configured mode for a request to P engine inst: auto and push ask
// P's GET /v1/kv_transfer (cached); push without P's coordinates is push-serial.
func (l *legs) chooseFlow(ctx context.Context, inst Instance, hdr http.Header) (flow, engineInfo) {
	switch l.cfg.TransferMode {
	case TransferPull:
		return flowPull, engineInfo{}
	case TransferPushSerial:
		return flowPushSerial, engineInfo{}
	}
	info, err := l.infos.get(ctx, inst, hdr)
	if err != nil {
		// P cannot be asked; its leg will say why. Auto falls back to pull, push to serial.
		l.cfg.Logger.Debug("prefill engine's kv_transfer info unavailable", "instance", inst.String(), "err", err)
	}
	switch {
	case l.cfg.TransferMode == TransferPush && info.coordinates():
		return flowPush, info
	case l.cfg.TransferMode == TransferPush:
		return flowPushSerial, info
	case info.push && info.coordinates():
		return flowPush, info
	case info.push:
		return flowPushSerial, info
	}
	return flowPull, info
}
