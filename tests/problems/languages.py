"""Problems in C++, Node.js, Go, Java and Rust (stdin -> expected stdout), a reference and a broken
solution each, plus one program per failure kind (compile error, runtime error, timeout, memory
limit) for the per-language sandbox tests."""

from __future__ import annotations

from tangram_celery.common.actions import TestCase

# The same two problems in every language: the sum of the numbers on stdin (broken: drops the
# last one) and the word count of stdin's first line (broken: counts separators instead).
_SUM_CASES = [("3\n1 2 3", "6"), ("1\n-7", "-7"), ("4\n1000000000 1000000000 5 -5", "2000000000")]
_WORDS_CASES = [("hello big world", "3"), ("one", "1"), ("  spaced   out  words ", "3")]

_SPECS: dict[str, dict[str, tuple[str, str]]] = {
    "cpp": {
        "sum": (
            "#include <iostream>\nint main(){int n;long long s=0,x;std::cin>>n;"
            "for(int i=0;i<n;i++){std::cin>>x;s+=x;}std::cout<<s<<std::endl;}\n",
            "#include <iostream>\nint main(){int n;long long s=0,x;std::cin>>n;"
            "for(int i=0;i<n-1;i++){std::cin>>x;s+=x;}std::cout<<s<<std::endl;}\n",
        ),
        "words": (
            "#include <iostream>\n#include <sstream>\n#include <string>\n"
            "int main(){std::string l,w;std::getline(std::cin,l);std::istringstream in(l);int c=0;"
            "while(in>>w)c++;std::cout<<c<<'\\n';}\n",
            "#include <iostream>\n#include <string>\n"
            "int main(){std::string l;std::getline(std::cin,l);int c=0;for(char ch:l)if(ch==' ')c++;"
            "std::cout<<c<<'\\n';}\n",
        ),
    },
    "nodejs": {
        "sum": (
            "const t=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);"
            "let s=0;for(let i=1;i<=t[0];i++)s+=t[i];console.log(String(s));\n",
            "const t=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);"
            "let s=0;for(let i=1;i<t[0];i++)s+=t[i];console.log(String(s));\n",
        ),
        "words": (
            "const l=require('fs').readFileSync(0,'utf8').split('\\n')[0];"
            "console.log(l.split(/\\s+/).filter(w=>w.length>0).length);\n",
            "const l=require('fs').readFileSync(0,'utf8').split('\\n')[0];"
            "console.log(l.split(' ').length-1);\n",
        ),
    },
    "go": {
        "sum": (
            'package main\nimport "fmt"\nfunc main(){var n int;fmt.Scan(&n);var s int64\n'
            "for i:=0;i<n;i++{var x int64;fmt.Scan(&x);s+=x}\nfmt.Println(s)}\n",
            'package main\nimport "fmt"\nfunc main(){var n int;fmt.Scan(&n);var s int64\n'
            "for i:=0;i<n-1;i++{var x int64;fmt.Scan(&x);s+=x}\nfmt.Println(s)}\n",
        ),
        "words": (
            'package main\nimport ("bufio";"fmt";"os";"strings")\nfunc main(){r:=bufio.NewReader(os.Stdin)\n'
            "l,_:=r.ReadString(10)\nfmt.Println(len(strings.Fields(l)))}\n",
            'package main\nimport ("bufio";"fmt";"os";"strings")\nfunc main(){r:=bufio.NewReader(os.Stdin)\n'
            'l,_:=r.ReadString(10)\nfmt.Println(strings.Count(l," "))}\n',
        ),
    },
    "java": {
        "sum": (
            "import java.util.*;\npublic class Main{public static void main(String[] a){"
            "Scanner s=new Scanner(System.in);int n=s.nextInt();long t=0;"
            "for(int i=0;i<n;i++)t+=s.nextLong();System.out.println(t);}}\n",
            "import java.util.*;\npublic class Main{public static void main(String[] a){"
            "Scanner s=new Scanner(System.in);int n=s.nextInt();long t=0;"
            "for(int i=0;i<n-1;i++)t+=s.nextLong();System.out.println(t);}}\n",
        ),
        # a public class not named Main: the runner names the file after it
        "words": (
            "import java.io.*;\npublic class Words{public static void main(String[] a)throws IOException{"
            "String l=new BufferedReader(new InputStreamReader(System.in)).readLine().trim();"
            'System.out.println(l.isEmpty()?0:l.split("\\\\s+").length);}}\n',
            "import java.io.*;\npublic class Words{public static void main(String[] a)throws IOException{"
            "String l=new BufferedReader(new InputStreamReader(System.in)).readLine();"
            'System.out.println(l.split(" ").length);}}\n',
        ),
    },
    "rust": {
        "sum": (
            "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s)"
            ".unwrap();let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();"
            'let n=v[0] as usize;println!("{}",v[1..=n].iter().sum::<i64>());}\n',
            "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s)"
            ".unwrap();let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();"
            'let n=v[0] as usize;println!("{}",v[1..n].iter().sum::<i64>());}\n',
        ),
        "words": (
            "fn main(){let mut l=String::new();std::io::stdin().read_line(&mut l).unwrap();"
            'println!("{}",l.split_whitespace().count());}\n',
            "fn main(){let mut l=String::new();std::io::stdin().read_line(&mut l).unwrap();"
            "println!(\"{}\",l.matches(' ').count());}\n",
        ),
    },
}

# language -> failure kind -> a program that fails that way (memory: run with a small memory_mb)
FAILING: dict[str, dict[str, str]] = {
    "cpp": {
        "compile_error": "int main( { return 0; }\n",
        "runtime_error": '#include <stdexcept>\nint main(){throw std::runtime_error("boom");}\n',
        "timeout": "int main(){volatile unsigned long x=0;for(;;)x++;}\n",
        "memory": "#include <vector>\n#include <string>\nint main(){std::vector<std::string> v;"
        "for(;;)v.emplace_back(1<<20,'x');}\n",
    },
    "nodejs": {
        "compile_error": "function ( {\n",  # no compile phase: a syntax error fails the run
        "runtime_error": "throw new Error('boom');\n",
        "timeout": "for(;;){}\n",
        "memory": "const a=[];for(;;)a.push(new Array(1<<16).fill(1.5));\n",
    },
    "go": {
        "compile_error": "package main\nfunc main( {\n",
        "runtime_error": 'package main\nfunc main(){panic("boom")}\n',
        "timeout": "package main\nfunc main(){x:=0\nfor{x++}}\n",
        "memory": "package main\nfunc main(){var k [][]byte\nfor{b:=make([]byte,1<<20)\n"
        "for i:=range b{b[i]=1}\nk=append(k,b)}}\n",
    },
    "java": {
        "compile_error": "public class Main{public static void main(String[] a){int x=}}\n",
        "runtime_error": "public class Main{public static void main(String[] a){"
        'throw new RuntimeException("boom");}}\n',
        "timeout": "public class Main{public static void main(String[] a){long x=0;while(true)x++;}}\n",
        "memory": "import java.util.*;\npublic class Main{public static void main(String[] a){"
        "List<byte[]> l=new ArrayList<>();while(true)l.add(new byte[1<<20]);}}\n",
    },
    "rust": {
        "compile_error": "fn main( {\n",
        "runtime_error": 'fn main(){panic!("boom");}\n',
        "timeout": 'fn main(){let mut x:u64=1;loop{x=x.wrapping_mul(3);if x==0{println!("{}",x);}}}\n',
        "memory": "fn main(){let mut v=Vec::new();loop{v.push(vec![1u8;1<<20]);}}\n",
    },
}
NEW_LANGUAGES = tuple(_SPECS)


def language_problems() -> list:
    """The problems above as `Problem`s (two per language)."""
    from tests.problems import Problem

    out = []
    for lang, problems in _SPECS.items():
        for kind, (ref, bad) in problems.items():
            cases = _SUM_CASES if kind == "sum" else _WORDS_CASES
            name = f"{lang}_{kind}"
            tests = [
                TestCase(name=f"{name}_{i}", stdin=s, expected_stdout=e) for i, (s, e) in enumerate(cases)
            ]
            out.append(Problem(name=name, language=lang, reference=ref, broken=bad, tests=tests))
    return out
