package connector

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/kvbridge/kvbridge/internal/kvlease"
	"github.com/kvbridge/kvbridge/kvcache"
)

// errLeaseGone marks a read whose lease the producer no longer holds (or never held).
var errLeaseGone = errors.New("no such lease")

// verifyRead checks what a read brought against what the producer published, read after the
// data (one-sided, on every backend): the lease slot must hold the tag of j's params — the lease
// was alive when the slot was read, so it held the blocks unchanged since before the data was
// read — and every block's record must carry the generation the params name, the number of
// tokens the params say it holds, and the chain hash of the reader's own prompt at that
// position. records[k] is the record read for plan pair k, slot the slot read; rbs is the
// producer's block size. It returns the index in j.blocks of the first block that cannot be
// used. A pure function: the core's decisions are testable without memory or sockets.
func verifyRead(j loadJob, remoteID string, rbs int, plan readPlan, records [][]byte, slot []byte) (int, error) {
	p := j.params
	want := kvlease.Tag(p.Lease, p.RemoteNumTokens, p.Blocks(), p.BlockGenerations)
	if len(slot) < len(want) || !bytes.Equal(slot[:len(want)], want[:]) {
		return plan.firstLocal, fmt.Errorf("%w: %w: %w: request %s: engine %s holds no lease matching these kv_transfer_params (it expired, was released or evicted, or the params are not its own)",
			errLeaseGone, ErrStaleBlocks, ErrVerification, j.id, remoteID)
	}
	own := j.prompt
	chain := kvcache.ChainHashes(own, rbs)
	for k, raw := range records {
		rec := kvcache.DecodeRecord(raw)
		rj := plan.remoteIndex[k]
		bad := func(format string, args ...any) (int, error) {
			return plan.localIndex[k], fmt.Errorf("%w: request %s, remote block %d (#%d): %s", ErrVerification, j.id, p.Blocks()[rj], rj, fmt.Sprintf(format, args...))
		}
		if rec.Gen != p.BlockGenerations[rj] {
			return plan.localIndex[k], fmt.Errorf("%w: %w: request %s, remote block %d (#%d): generation %d, the params name %d",
				ErrVerification, ErrStaleBlocks, j.id, p.Blocks()[rj], rj, rec.Gen, p.BlockGenerations[rj])
		}
		n := min(rbs, p.RemoteNumTokens-rj*rbs)
		switch {
		case n <= 0:
			return bad("the params say it holds no token")
		case rec.Count != n:
			return bad("it holds %d tokens, the params say %d", rec.Count, n)
		case rj*rbs+n > len(own):
			return bad("it holds tokens %d to %d, beyond this prompt's %d", rj*rbs, rj*rbs+n, len(own))
		}
		var hash kvcache.BlockHash
		if n == rbs {
			hash = chain[rj]
		} else {
			var parent kvcache.BlockHash
			if rj > 0 {
				parent = chain[rj-1]
			}
			hash = kvcache.NextHash(parent, own[rj*rbs:rj*rbs+n])
		}
		if rec.Hash != hash {
			return bad("its tokens are not this prompt's")
		}
	}
	return 0, nil
}

// scratchEntry returns scratch entry i (a record or a slot read from a producer).
func (c *Connector) scratchEntry(i int) []byte {
	return c.scratch[i*kvcache.RecordBytes : (i+1)*kvcache.RecordBytes]
}
