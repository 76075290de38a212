package connector

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/kvbridge/kvbridge/internal/kvlease"
)

// Extension keys kvbridge adds to kv_transfer_params. vLLM ignores keys it does not know.
const (
	// KeyBlockGenerations carries the producer's generation of each block (block-major, first
	// group), so a read of blocks that were freed and reused is detected.
	KeyBlockGenerations = "kvbridge_block_generations"
	// KeyBlockHashes carries the hash chain of the producer's full blocks, so a consumer pulls
	// only the prefix whose tokens match its own prompt.
	KeyBlockHashes = "kvbridge_block_hashes"
	// KeyInstance names the producer's instance (random per start), so that params issued
	// before a restart are recognised as stale even when block ids and generations repeat.
	KeyInstance = "kvbridge_instance"
	// KeyLease carries the lease token (32 hex digits): the capability every read,
	// notification and heartbeat about these blocks must present (see kvlease.Token).
	KeyLease = "kvbridge_lease"
	// KeyLeaseSlot is the index of the slot where the producer publishes the lease's tag.
	KeyLeaseSlot = "kvbridge_lease_slot"
	// KeyMAC is the issuer's HMAC of the params when engines share an auth token (see mac.go).
	KeyMAC = "kvbridge_params_mac"
)

// maxRemoteBlocks bounds remote_block_ids (2^20 blocks of 16 tokens: 16M tokens), and the
// num_blocks a producer publishes over the side channel, which sizes a consumer's descriptor
// lists for that producer.
const maxRemoteBlocks = 1 << 20

// Params is kv_transfer_params (docs/architecture.md, "kv_transfer_params"): what one engine
// tells the next about KV it holds.
type Params struct {
	DoRemoteDecode  bool
	DoRemotePrefill bool
	// RemoteBlockIDs has one list per KV-cache group; kvbridge engines use one group.
	RemoteBlockIDs  [][]int32
	RemoteEngineID  string
	RemoteRequestID string
	RemoteHost      string
	RemotePort      int
	TPSize          int
	DCPSize         int
	PPSize          int
	// RemoteNumTokens is the producer's computed-token count; 0 when absent.
	RemoteNumTokens int
	// RemoteBlocksExpiryTime is D's deadline on D's clock in seconds; nil when absent.
	RemoteBlocksExpiryTime *float64
	TransferMode           string
	BlockGenerations       []uint64
	BlockHashes            []string
	Instance               string
	// Lease is the lease token; HasLease says whether the params carried one.
	Lease    kvlease.Token
	HasLease bool
	// LeaseSlot is the producer's slot of the lease's tag; -1 when absent.
	LeaseSlot int
	// MAC is the issuer's HMAC (hex), "" when absent.
	MAC string
	// PushID is push_id: the rendezvous a proxy that sends both legs at once gives a push
	// prefiller and its decoder, "" when absent (push.go).
	PushID string
}

// maxPushIDBytes bounds push_id.
const maxPushIDBytes = 128

// PushComplete reports whether p asks a push decoder to register its blocks with a producer:
// do_remote_prefill, no remote_block_ids, the producer's engine id, host and port, and the
// request to match — P's remote_request_id (the serial flow) or a push_id (both legs at once).
func (p *Params) PushComplete() bool {
	return p != nil && p.DoRemotePrefill && len(p.Blocks()) == 0 && p.RemoteEngineID != "" && p.RemoteHost != "" && p.RemotePort > 0 &&
		(p.RemoteRequestID != "" || p.PushID != "")
}

// Blocks returns the first group's block ids.
func (p *Params) Blocks() []int32 {
	if p == nil || len(p.RemoteBlockIDs) == 0 {
		return nil
	}
	return p.RemoteBlockIDs[0]
}

// Complete reports whether p names remote blocks and everything needed to read them: block ids
// and the remote engine, request, host and port (docs/architecture.md, "kv_transfer_params";
// wire contract item 8).
func (p *Params) Complete() bool {
	return p != nil && len(p.Blocks()) > 0 && p.RemoteEngineID != "" && p.RemoteRequestID != "" && p.RemoteHost != "" && p.RemotePort > 0
}

// ParseParams decodes kv_transfer_params from a decoded JSON object. Absent and null fields take
// their zero values; a field of the wrong type is an error naming it. remote_block_ids may be a
// flat list (legacy) or a list of lists.
func ParseParams(m map[string]any) (*Params, error) {
	if m == nil {
		return nil, nil
	}
	p := Params{LeaseSlot: -1}
	var err error
	field := func(key string, f func(v any) error) {
		if v, ok := m[key]; ok && v != nil && err == nil {
			if e := f(v); e != nil {
				err = fmt.Errorf("%w: %s: %v", ErrParams, key, e)
			}
		}
	}
	field("do_remote_decode", func(v any) error { return asBool(v, &p.DoRemoteDecode) })
	field("do_remote_prefill", func(v any) error { return asBool(v, &p.DoRemotePrefill) })
	field("remote_block_ids", func(v any) error { return asBlockIDs(v, &p.RemoteBlockIDs) })
	field("remote_engine_id", func(v any) error { return asString(v, &p.RemoteEngineID) })
	field("remote_request_id", func(v any) error { return asString(v, &p.RemoteRequestID) })
	field("remote_host", func(v any) error { return asString(v, &p.RemoteHost) })
	field("remote_port", func(v any) error { return asInt(v, &p.RemotePort, 0, 65535) })
	field("tp_size", func(v any) error { return asInt(v, &p.TPSize, 1, 1<<16) })
	field("dcp_size", func(v any) error { return asInt(v, &p.DCPSize, 1, 1<<16) })
	field("pp_size", func(v any) error { return asInt(v, &p.PPSize, 1, 1<<16) })
	field("remote_num_tokens", func(v any) error { return asInt(v, &p.RemoteNumTokens, 0, math.MaxInt32) })
	field("remote_blocks_expiry_time", func(v any) error {
		f, e := asFloat(v)
		p.RemoteBlocksExpiryTime = &f
		return e
	})
	field("transfer_mode", func(v any) error { return asString(v, &p.TransferMode) })
	field(KeyInstance, func(v any) error { return asString(v, &p.Instance) })
	field(KeyLease, func(v any) error {
		var hexTok string
		if err := asString(v, &hexTok); err != nil {
			return err
		}
		tok, err := kvlease.ParseToken(hexTok)
		p.Lease, p.HasLease = tok, err == nil
		return err
	})
	field(KeyLeaseSlot, func(v any) error { return asInt(v, &p.LeaseSlot, 0, math.MaxInt32) })
	field(KeyMAC, func(v any) error { return asString(v, &p.MAC) })
	field("push_id", func(v any) error {
		if err := asString(v, &p.PushID); err != nil {
			return err
		}
		if len(p.PushID) > maxPushIDBytes {
			return fmt.Errorf("longer than %d bytes", maxPushIDBytes)
		}
		return nil
	})
	field(KeyBlockGenerations, func(v any) error {
		list, ok := v.([]any)
		if !ok {
			return errors.New("want a list of integers")
		}
		p.BlockGenerations = make([]uint64, len(list))
		for i, e := range list {
			f, err := asFloat(e)
			if err != nil || f < 0 || f != math.Trunc(f) || f > 1<<53 {
				return fmt.Errorf("element %d is not a generation", i)
			}
			p.BlockGenerations[i] = uint64(f)
		}
		return nil
	})
	field(KeyBlockHashes, func(v any) error {
		list, ok := v.([]any)
		if !ok {
			return errors.New("want a list of strings")
		}
		p.BlockHashes = make([]string, len(list))
		for i, e := range list {
			if err := asString(e, &p.BlockHashes[i]); err != nil {
				return fmt.Errorf("element %d: %v", i, err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := p.checkBlocks(); err != nil {
		return nil, err
	}
	return &p, nil
}

// checkBlocks refuses block lists no producer issues: too long, an id twice in a group (one
// block read into several positions), or generations that do not pair with the first group.
func (p *Params) checkBlocks() error {
	for g, ids := range p.RemoteBlockIDs {
		if len(ids) > maxRemoteBlocks {
			return fmt.Errorf("%w: remote_block_ids: group %d names %d blocks, at most %d", ErrParams, g, len(ids), maxRemoteBlocks)
		}
		seen := make(map[int32]struct{}, len(ids))
		for _, id := range ids {
			if _, dup := seen[id]; dup {
				return fmt.Errorf("%w: remote_block_ids: group %d names block %d twice", ErrParams, g, id)
			}
			seen[id] = struct{}{}
		}
	}
	if p.BlockGenerations != nil && len(p.BlockGenerations) != len(p.Blocks()) {
		return fmt.Errorf("%w: %s: %d generations for %d blocks", ErrParams, KeyBlockGenerations, len(p.BlockGenerations), len(p.Blocks()))
	}
	return nil
}

// Map encodes p as a JSON-ready object with vLLM's field names.
func (p *Params) Map() map[string]any {
	ids := make([]any, len(p.RemoteBlockIDs))
	for i, g := range p.RemoteBlockIDs {
		ids[i] = g
	}
	m := map[string]any{
		"do_remote_decode":          p.DoRemoteDecode,
		"do_remote_prefill":         p.DoRemotePrefill,
		"remote_block_ids":          ids,
		"remote_engine_id":          p.RemoteEngineID,
		"remote_request_id":         p.RemoteRequestID,
		"remote_host":               p.RemoteHost,
		"remote_port":               p.RemotePort,
		"tp_size":                   max(p.TPSize, 1),
		"dcp_size":                  max(p.DCPSize, 1),
		"pp_size":                   max(p.PPSize, 1),
		"remote_num_tokens":         p.RemoteNumTokens,
		"remote_blocks_expiry_time": nil,
		"transfer_mode":             "pull",
	}
	if p.TransferMode != "" {
		m["transfer_mode"] = p.TransferMode
	}
	if p.RemoteBlocksExpiryTime != nil {
		m["remote_blocks_expiry_time"] = *p.RemoteBlocksExpiryTime
	}
	if p.BlockGenerations != nil {
		m[KeyBlockGenerations] = p.BlockGenerations
	}
	if p.BlockHashes != nil {
		m[KeyBlockHashes] = p.BlockHashes
	}
	if p.Instance != "" {
		m[KeyInstance] = p.Instance
	}
	if p.HasLease {
		m[KeyLease] = p.Lease.String()
		m[KeyLeaseSlot] = p.LeaseSlot
	}
	if p.MAC != "" {
		m[KeyMAC] = p.MAC
	}
	if p.PushID != "" {
		m["push_id"] = p.PushID
	}
	return m
}

func asBool(v any, dst *bool) error {
	b, ok := v.(bool)
	if !ok {
		return fmt.Errorf("want a boolean, got %s", describe(v))
	}
	*dst = b
	return nil
}

func asString(v any, dst *string) error {
	s, ok := v.(string)
	if !ok {
		return fmt.Errorf("want a string, got %s", describe(v))
	}
	*dst = s
	return nil
}

func asFloat(v any) (float64, error) {
	switch x := v.(type) {
	case float64:
		return x, nil
	case json.Number:
		f, err := strconv.ParseFloat(x.String(), 64)
		if err == nil && !math.IsInf(f, 0) {
			return f, nil
		}
	case int:
		return float64(x), nil
	case int32:
		return float64(x), nil
	case int64:
		return float64(x), nil
	}
	return 0, fmt.Errorf("want a number, got %s", describe(v))
}

func asInt(v any, dst *int, lo, hi int) error {
	f, err := asFloat(v)
	if err != nil {
		return err
	}
	if f != math.Trunc(f) || f < float64(lo) || f > float64(hi) {
		return fmt.Errorf("want an integer between %d and %d, got %v", lo, hi, f)
	}
	*dst = int(f)
	return nil
}

func asBlockIDs(v any, dst *[][]int32) error {
	switch x := v.(type) {
	case [][]int32:
		*dst = x
		return nil
	case []int32:
		*dst = [][]int32{x}
		return nil
	}
	list, ok := v.([]any)
	if !ok {
		return fmt.Errorf("want a list, got %s", describe(v))
	}
	flat := len(list) > 0
	for _, e := range list {
		if _, isList := e.([]any); isList {
			flat = false
		}
	}
	ids := func(l []any) ([]int32, error) {
		out := make([]int32, len(l))
		for i, e := range l {
			var n int
			if err := asInt(e, &n, 0, math.MaxInt32); err != nil {
				return nil, fmt.Errorf("block id %d: %v", i, err)
			}
			out[i] = int32(n)
		}
		return out, nil
	}
	if flat {
		g, err := ids(list)
		if err != nil {
			return err
		}
		*dst = [][]int32{g}
		return nil
	}
	out := make([][]int32, len(list))
	for i, e := range list {
		inner, ok := e.([]any)
		if !ok {
			return fmt.Errorf("group %d: want a list of block ids, got %s", i, describe(e))
		}
		g, err := ids(inner)
		if err != nil {
			return fmt.Errorf("group %d: %v", i, err)
		}
		out[i] = g
	}
	*dst = out
	return nil
}
