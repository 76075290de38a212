package blockhash

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os/exec"
	"strconv"
	"testing"
)

type pyCase struct {
	Algo      Algo    `json:"algo"`
	Seed      string  `json:"seed"`
	BlockSize int     `json:"block_size"`
	Tokens    []int32 `json:"tokens"`
}

// python returns an interpreter with cbor2 (Debian: python3-cbor2), or skips the test.
func python(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "python3"} {
		if exec.Command(p, "-c", "import cbor2").Run() == nil {
			return p
		}
	}
	t.Skip("no python3 with cbor2 (Debian: apt-get install python3-cbor2): vLLM's hashes cannot be computed independently")
	return ""
}

// TestMatchesVLLM checks the chains against vLLM's hash_block_tokens as Python computes them
// (testdata/vllm_block_hashes.py, with Python's own pickle and cbor2): both algorithms, token ids
// across every integer width the encodings distinguish, several block sizes and seeds.
func TestMatchesVLLM(t *testing.T) {
	py := python(t)
	r := rand.New(rand.NewPCG(1, 2))
	widths := []int32{23, 24, 255, 256, 65535, 65536, 151935, 1 << 30}
	var cases []pyCase
	for _, algo := range []Algo{SHA256, SHA256CBOR} {
		for _, bs := range []int{1, 2, 3, 4, 16, 32} {
			for _, seed := range []string{"0", "42", "a seed longer than twenty-three bytes", string(bytes.Repeat([]byte("s"), 300))} {
				// Every encoding boundary, then random ids of every width.
				toks := append([]int32{0, 23, 24, 255, 256, 65535, 65536, 1<<31 - 1}, make([]int32, bs*3+r.IntN(bs+1))...)
				for i := 8; i < len(toks); i++ {
					toks[i] = r.Int32N(widths[r.IntN(len(widths))] + 1)
				}
				cases = append(cases, pyCase{algo, seed, bs, toks})
			}
		}
	}
	in, err := json.Marshal(cases)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, "testdata/vllm_block_hashes.py")
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, stderr.String())
	}
	var want [][]string
	if err := json.Unmarshal(out, &want); err != nil {
		t.Fatal(err)
	}
	for i, c := range cases {
		h, err := New(c.Algo, c.Seed, true)
		if err != nil {
			t.Fatal(err)
		}
		got := h.Chain(c.Tokens, c.BlockSize)
		if len(got) != len(want[i]) {
			t.Fatalf("case %d (%s, block %d): %d hashes, vLLM %d", i, c.Algo, c.BlockSize, len(got), len(want[i]))
		}
		for j, g := range got {
			if s := strconv.FormatUint(g.External(), 10); s != want[i][j] {
				t.Fatalf("case %d (%s, block %d, seed %.10q) block %d: %s, vLLM %s", i, c.Algo, c.BlockSize, c.Seed, j, s, want[i][j])
			}
		}
	}
}

// TestUnseededIsPrivate: without PYTHONHASHSEED two hashers disagree (NONE_HASH is random), and
// a seeded one agrees with another of the same seed.
func TestUnseededIsPrivate(t *testing.T) {
	toks := []int32{1, 2, 3, 4}
	a, _ := FromEnv(SHA256CBOR, func(string) (string, bool) { return "", false })
	b, _ := FromEnv(SHA256CBOR, func(string) (string, bool) { return "", false })
	if a.Seeded() || a.First(toks) == b.First(toks) {
		t.Fatal("unseeded hashers agree")
	}
	env := func(string) (string, bool) { return "7", true }
	c, _ := FromEnv(SHA256CBOR, env)
	d, _ := FromEnv(SHA256CBOR, env)
	if !c.Seeded() || c.First(toks) != d.First(toks) {
		t.Fatal("hashers with the same PYTHONHASHSEED disagree")
	}
}

func TestParseAlgo(t *testing.T) {
	for _, s := range []string{"xxhash", "xxhash_cbor", "md5", ""} {
		if _, err := ParseAlgo(s); !errors.Is(err, ErrAlgo) {
			t.Errorf("ParseAlgo(%q) = %v, want ErrAlgo", s, err)
		}
	}
	if h, _ := New(SHA256, "1", true); h.Chain([]int32{1, 2, 3}, 4) != nil || h.Chain([]int32{1}, 0) != nil {
		t.Error("a chain without a full block is not empty")
	}
}
