package proxy

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// D's kv_transfer_params name the blocks D holds for a conversation's next turn and carry their
// lease token: whoever reads them could pull that KV, or try to end the hold. The multi-turn
// proxy therefore keeps them sealed in its conversation store (in memory and in Redis): AES-256-GCM
// under a key derived with HKDF-SHA256 from MultiTurnConfig.StoreKey, the entry bound to its
// conversation id, decoder and digests (a sealed entry moved to another conversation, or with
// another decoder, does not open). An entry that does not open — tampered with, or sealed under
// another key — is a miss, counted; never an error to the client.

// errUnsealable reports a stored turn that does not open under this proxy's key.
var errUnsealable = errors.New("the stored turn does not open under this proxy's conversation store key (tampered with, or sealed under another key)")

// sealer seals and opens the params of stored turns.
type sealer struct {
	aead cipher.AEAD
}

// newSealer derives the store key from secret; an empty secret draws a random key, which only
// this process knows.
func newSealer(secret string) (*sealer, error) {
	ikm := []byte(secret)
	if secret == "" {
		ikm = make([]byte, 32)
		if _, err := rand.Read(ikm); err != nil {
			return nil, fmt.Errorf("proxy: drawing a conversation store key: %w", err)
		}
	}
	key, err := hkdf.Key(sha256.New, ikm, nil, "kvbridge conversation store v1", 32)
	if err != nil {
		return nil, fmt.Errorf("proxy: deriving the conversation store key: %w", err)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("proxy: conversation store cipher: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("proxy: conversation store cipher: %w", err)
	}
	return &sealer{aead: aead}, nil
}

// seal returns t with its params sealed into t.sealed and removed.
func (s *sealer) seal(conv string, t turn) (turn, error) {
	plain, err := json.Marshal(t.params)
	if err != nil {
		return t, fmt.Errorf("proxy: encoding params to store: %w", err)
	}
	nonce := make([]byte, s.aead.NonceSize(), s.aead.NonceSize()+len(plain)+s.aead.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return t, fmt.Errorf("proxy: drawing a nonce: %w", err)
	}
	t.sealed = s.aead.Seal(nonce, nonce, plain, binding(conv, t))
	t.params = nil
	return t, nil
}

// open returns t with the params of t.sealed, or errUnsealable.
func (s *sealer) open(conv string, t turn) (turn, error) {
	n := s.aead.NonceSize()
	if len(t.sealed) < n+s.aead.Overhead() {
		return t, errUnsealable
	}
	plain, err := s.aead.Open(nil, t.sealed[:n], t.sealed[n:], binding(conv, t))
	if err != nil {
		return t, errUnsealable
	}
	var params map[string]any
	dec := json.NewDecoder(bytes.NewReader(plain))
	dec.UseNumber() // numbers go to P as D wrote them
	if err := dec.Decode(&params); err != nil || params == nil {
		return t, fmt.Errorf("%w: the params are not a JSON object", errUnsealable)
	}
	t.params, t.sealed = params, nil
	return t, nil
}

// binding is the additional data a turn's seal covers: the conversation id and everything else
// the store keeps of the turn, each part length-prefixed.
func binding(conv string, t turn) []byte {
	var b []byte
	for _, part := range [][]byte{[]byte("kvbridge conversation turn v1"), []byte(conv), []byte(t.decoder.Host),
		strconv.AppendInt(nil, int64(t.decoder.Port), 10), strconv.AppendBool(nil, t.chat),
		strconv.AppendInt(nil, int64(t.prefixLen), 10), t.prefix[:], t.answer[:]} {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(part)))
		b = append(b, part...)
	}
	return b
}
