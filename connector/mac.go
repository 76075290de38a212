package connector

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
	"strconv"
)

// With an auth token, the engine that issues kv_transfer_params MACs them (KeyMAC), and an
// engine refuses to act on params — dial, read, notify — whose MAC does not verify: an HTTP
// client cannot make up params, only hand back ones an engine issued. The MAC covers every
// field the reader acts on except remote_host and remote_port, which proxies rewrite (the
// multi-turn proxy puts the engine's HTTP host there); whoever answers at that address must
// still pass the side channel's and the transfer engine's authentication with the same token.

// paramsMACKey derives the params key from the auth token, apart from the side-channel proofs.
func paramsMACKey(token string) []byte {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte("kvbridge params mac v1"))
	return m.Sum(nil)
}

// paramsMAC returns the hex HMAC-SHA256 of p's covered fields under key.
func paramsMAC(key []byte, p *Params) string {
	m := hmac.New(sha256.New, key)
	var n [8]byte
	field := func(b []byte) {
		binary.LittleEndian.PutUint64(n[:], uint64(len(b)))
		m.Write(n[:])
		m.Write(b)
	}
	flag := func(v bool) []byte {
		if v {
			return []byte{1}
		}
		return []byte{0}
	}
	num := func(v int) []byte { return strconv.AppendInt(nil, int64(v), 10) }
	field([]byte("kvbridge params v1"))
	field(flag(p.DoRemoteDecode))
	field(flag(p.DoRemotePrefill))
	field([]byte(p.RemoteEngineID))
	field([]byte(p.RemoteRequestID))
	field([]byte(p.Instance))
	field(flag(p.HasLease))
	field(p.Lease[:])
	field(num(p.LeaseSlot))
	field(num(p.RemoteNumTokens))
	if p.RemoteBlocksExpiryTime != nil {
		binary.LittleEndian.PutUint64(n[:], math.Float64bits(*p.RemoteBlocksExpiryTime))
		field(n[:])
	} else {
		field(nil)
	}
	field(num(len(p.RemoteBlockIDs)))
	for _, g := range p.RemoteBlockIDs {
		b := make([]byte, 0, 4*len(g))
		for _, id := range g {
			b = binary.LittleEndian.AppendUint32(b, uint32(id))
		}
		field(b)
	}
	gens := make([]byte, 0, 8*len(p.BlockGenerations))
	for _, g := range p.BlockGenerations {
		gens = binary.LittleEndian.AppendUint64(gens, g)
	}
	field(gens)
	field(num(len(p.BlockHashes)))
	for _, h := range p.BlockHashes {
		field([]byte(h))
	}
	return hex.EncodeToString(m.Sum(nil))
}

// verifyMAC reports whether p carries a valid MAC under key.
func verifyMAC(key []byte, p *Params) bool {
	want := paramsMAC(key, p)
	return hmac.Equal([]byte(p.MAC), []byte(want))
}
