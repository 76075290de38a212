package proxy

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// conversationStore keeps each conversation's last turn between turns: single use (of
// concurrent takers of one conversation exactly one gets its turn) and a TTL. The in-memory
// ConversationCache is the embedded default; redisStore shares conversations between the
// replicas of a proxy tier. A store that fails (Redis down) makes turns misses, never errors.
type conversationStore interface {
	take(ctx context.Context, conv string) (turn, bool, error)
	put(ctx context.Context, conv string, t turn) error
	close() error
}

// storeTimeout bounds one store round trip; a slower store is a miss.
const storeTimeout = time.Second

// redisStore keeps conversations in Redis: a key per conversation holding its last turn, with
// Redis's expiry as the TTL and GETDEL as the single-use claim, atomic across replicas. The
// bound on memory is Redis's: run it with maxmemory and maxmemory-policy allkeys-lru (or
// volatile-lru), so that the least recently stored conversations go first.
type redisStore struct {
	client *redis.Client
	ttl    time.Duration
	prefix string
	up     atomic.Bool // the last round trip succeeded
}

// newRedisStore connects to the Redis URL (redis://[user:password@]host:port[/db]).
func newRedisStore(rawURL string, ttl time.Duration) (*redisStore, error) {
	opt, err := redis.ParseURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("proxy: conversation store %q: %w", rawURL, err)
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout = storeTimeout, storeTimeout, storeTimeout
	opt.MaxRetries = 0    // a failed round trip is a miss; the next request tries again
	opt.DialerRetries = 1 // the same for a failed dial
	s := &redisStore{client: redis.NewClient(opt), ttl: ttl, prefix: "kvbridge:conversation:"}
	s.up.Store(true)
	return s, nil
}

// storedTurn is a turn as Redis holds it: the params sealed (seal.go), never in clear text.
type storedTurn struct {
	Sealed    []byte `json:"sealed"`
	Host      string `json:"decoder_host"`
	Port      int    `json:"decoder_port"`
	Chat      bool   `json:"chat"`
	PrefixLen int    `json:"prefix_len"`
	Prefix    string `json:"prefix"`
	Answer    string `json:"answer"`
}

func (s *redisStore) take(ctx context.Context, conv string) (turn, bool, error) {
	data, err := s.client.GetDel(ctx, s.prefix+conv).Bytes()
	if errors.Is(err, redis.Nil) {
		s.up.Store(true)
		return turn{}, false, nil
	}
	s.up.Store(err == nil)
	if err != nil {
		return turn{}, false, fmt.Errorf("redis GETDEL: %w", err)
	}
	var st storedTurn
	if err := json.Unmarshal(data, &st); err != nil {
		return turn{}, false, fmt.Errorf("redis: a stored turn is not JSON: %w", err)
	}
	t := turn{sealed: st.Sealed, chat: st.Chat, prefixLen: st.PrefixLen}
	if t.decoder, err = NewInstance(st.Host, st.Port); err != nil {
		return turn{}, false, fmt.Errorf("redis: stored decoder: %w", err)
	}
	if hex.DecodedLen(len(st.Prefix)) != len(t.prefix) || hex.DecodedLen(len(st.Answer)) != len(t.answer) {
		return turn{}, false, errors.New("redis: stored digests have the wrong length")
	}
	_, err1 := hex.Decode(t.prefix[:], []byte(st.Prefix))
	_, err2 := hex.Decode(t.answer[:], []byte(st.Answer))
	if err := errors.Join(err1, err2); err != nil {
		return turn{}, false, fmt.Errorf("redis: stored digests: %w", err)
	}
	return t, true, nil
}

func (s *redisStore) put(ctx context.Context, conv string, t turn) error {
	data, err := json.Marshal(storedTurn{Sealed: t.sealed, Host: t.decoder.Host, Port: t.decoder.Port, Chat: t.chat,
		PrefixLen: t.prefixLen, Prefix: hex.EncodeToString(t.prefix[:]), Answer: hex.EncodeToString(t.answer[:])})
	if err != nil {
		return err
	}
	err = s.client.Set(ctx, s.prefix+conv, data, s.ttl).Err()
	s.up.Store(err == nil)
	if err != nil {
		return fmt.Errorf("redis SET: %w", err)
	}
	return nil
}

func (s *redisStore) close() error { return s.client.Close() }

// ping checks that Redis answers (PING) and records the result as the last round trip's.
func (s *redisStore) ping(ctx context.Context) error {
	err := s.client.Ping(ctx).Err()
	s.up.Store(err == nil)
	if err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	return nil
}

// expiredKeys returns the Redis server's count of keys it expired (INFO stats expired_keys), or
// -1 when it cannot be read.
func (s *redisStore) expiredKeys(ctx context.Context) int64 {
	info, err := s.client.Info(ctx, "stats").Result()
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "expired_keys:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err == nil {
				return n
			}
		}
	}
	return -1
}

// The in-memory ConversationCache as a conversationStore.

func (c *ConversationCache) take(_ context.Context, conv string) (turn, bool, error) {
	t, ok := c.takeTurn(conv)
	return t, ok, nil
}

func (c *ConversationCache) put(_ context.Context, conv string, t turn) error {
	c.putTurn(conv, t)
	return nil
}

func (c *ConversationCache) close() error { return nil }
