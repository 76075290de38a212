package kvlease

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"
)

// The notifications a reader sends the owner of the blocks it reads, over the transfer engine.
// vLLM sends "<request id>:<readers>" and "HB:<request id>,…"; kvbridge's carry the lease
// token instead of (heartbeats) or beside (completions) the request id, so that nobody but the
// holder of the params can extend another request's lease, and a completion also carries a
// proof that its sender holds the prompt the lease was issued for (Proof), so that
// params copied into a request for another prompt cannot end it either.

// HeartbeatPrefix starts a heartbeat notification: "HB:" followed by comma-joined lease tokens.
const HeartbeatPrefix = "HB:"

// FormatHeartbeat renders the heartbeat message for lease tokens (hex).
func FormatHeartbeat(tokens []string) string { return HeartbeatPrefix + strings.Join(tokens, ",") }

// ParseHeartbeat returns the tokens of a heartbeat message, and false if msg is not a heartbeat.
func ParseHeartbeat(msg string) ([]string, bool) {
	rest, ok := strings.CutPrefix(msg, HeartbeatPrefix)
	if !ok {
		return nil, false
	}
	if rest == "" {
		return nil, true
	}
	return strings.Split(rest, ","), true
}

// ProofBytes is the length of a release notification's proof.
const ProofBytes = 16

// Proof proves that the sender of a release notification holds tokens, the leading
// tokens of the prompt the lease was issued for: the first ProofBytes of HMAC-SHA256
// keyed by the lease token over a context string, the tokens and their count. The owner of the
// blocks computed the proofs it accepts when it issued the lease (Lease.Proofs); anybody can
// compute a proof for a prompt it holds, nobody for one it does not hold.
func Proof(token Token, tokens []int32) [ProofBytes]byte {
	return Proofs(token, tokens, []int{len(tokens)})[0]
}

// Proofs returns Proof(token, tokens[:n]) for each n of lengths (ascending, each at
// most len(tokens)), hashing the tokens once: the count comes last, so that one MAC state runs
// through the prefixes and is cloned at each length.
func Proofs(token Token, tokens []int32, lengths []int) [][ProofBytes]byte {
	m := hmac.New(sha256.New, token[:])
	m.Write([]byte("kvbridge release v1"))
	out := make([][ProofBytes]byte, len(lengths))
	var b [8]byte
	done := 0
	for i, n := range lengths {
		for ; done < n; done++ {
			binary.LittleEndian.PutUint32(b[:4], uint32(tokens[done]))
			m.Write(b[:4])
		}
		h := m
		if i+1 < len(lengths) { // m runs on: finish a clone of it
			c, ok := m.(hash.Cloner)
			var clone hash.Cloner
			var err error
			if ok {
				clone, err = c.Clone()
			}
			if !ok || err != nil {
				out[i] = Proof(token, tokens[:n])
				continue
			}
			h = clone
		}
		binary.LittleEndian.PutUint64(b[:], uint64(n))
		h.Write(b[:])
		copy(out[i][:], h.Sum(nil))
	}
	return out
}

// Release is a parsed release notification: one of Readers readers of the blocks leased to
// request ID under Token is done with them, and proves that it holds the first Proven tokens
// of the lease's prompt (Proof, see Proof). ReaderTP is the reading engine's tensor-parallel
// size (0: not given), from which the owner derives how many notifications vLLM's ranks would
// have sent (one per pair of reader rank and owner rank that read).
type Release struct {
	ID       string
	Readers  int
	Token    Token
	Proven   int
	Proof    [ProofBytes]byte
	ReaderTP int
}

// ReaderTPPrefix starts the optional last field of a release notification (version 2): the
// reader's tensor-parallel size, "tp<n>". A reader appends it only for an owner that
// advertises that it parses it (connector: the handshake metadata's release_reader_tp), so
// that an owner that parses only version 1 never sees it.
const ReaderTPPrefix = "tp"

// MaxReaderTP bounds the reader TP size a release notification may carry.
const MaxReaderTP = 4096

// FormatRelease renders r as "<id>:<readers>:<token>:<proven>:<proof>" (version 1: token and
// proof in hex), followed by ":tp<n>" when r.ReaderTP > 0 (version 2). vLLM's notification is
// "<id>:<readers>"; kvbridge appends the lease token and the proof, and the reader's TP size.
func FormatRelease(r Release) string {
	s := r.ID + ":" + strconv.Itoa(r.Readers) + ":" + r.Token.String() + ":" + strconv.Itoa(r.Proven) + ":" + hex.EncodeToString(r.Proof[:])
	if r.ReaderTP > 0 {
		s += ":" + ReaderTPPrefix + strconv.Itoa(r.ReaderTP)
	}
	return s
}

// AppendReaderTP turns the version-1 release notification msg into version 2 by appending the
// reader's tensor-parallel size tp (see ReaderTPPrefix).
func AppendReaderTP(msg []byte, tp int) []byte {
	out := make([]byte, 0, len(msg)+8)
	out = append(out, msg...)
	out = append(out, ':')
	out = append(out, ReaderTPPrefix...)
	return strconv.AppendInt(out, int64(tp), 10)
}

// errNotification reports a notification that is neither a heartbeat nor a release.
var errNotification = errors.New("malformed KV notification")

// ParseRelease parses "<id>:<readers>:<token>:<proven>:<proof>", optionally followed by
// ":tp<n>" (version 2, see FormatRelease); the id may itself contain colons. A proof is hex, so
// a last field starting with "tp" is never one.
func ParseRelease(msg string) (Release, error) {
	var r Release
	if rest, last, ok := cutLast(msg, ':'); ok && strings.HasPrefix(last, ReaderTPPrefix) {
		n, err := strconv.Atoi(last[len(ReaderTPPrefix):])
		if err != nil || n < 1 || n > MaxReaderTP {
			return r, fmt.Errorf("%w: reader TP size %q", errNotification, clip(last))
		}
		r.ReaderTP, msg = n, rest
	}
	rest, proof, ok := cutLast(msg, ':')
	if !ok || len(proof) != 2*ProofBytes {
		return r, fmt.Errorf("%w: no release proof", errNotification)
	}
	if _, err := hex.Decode(r.Proof[:], []byte(proof)); err != nil {
		return r, fmt.Errorf("%w: the release proof is not hex: %v", errNotification, err)
	}
	rest, proven, ok := cutLast(rest, ':')
	var err error
	if r.Proven, err = strconv.Atoi(proven); !ok || err != nil || r.Proven < 0 {
		return r, fmt.Errorf("%w: proven tokens %q", errNotification, clip(proven))
	}
	rest, tok, ok := cutLast(rest, ':')
	if !ok {
		return r, fmt.Errorf("%w: no lease token", errNotification)
	}
	if r.Token, err = ParseToken(tok); err != nil {
		return r, fmt.Errorf("%w: %v", errNotification, err)
	}
	id, n, ok := cutLast(rest, ':')
	if !ok || id == "" {
		return r, fmt.Errorf("%w: no request id", errNotification)
	}
	if r.Readers, err = strconv.Atoi(n); err != nil || r.Readers < 1 {
		return r, fmt.Errorf("%w: readers %q", errNotification, clip(n))
	}
	r.ID = id
	return r, nil
}

// cutLast splits s around the last sep.
func cutLast(s string, sep byte) (before, after string, found bool) {
	i := strings.LastIndexByte(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}

// clip shortens an untrusted string for messages.
func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
